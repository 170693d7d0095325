"""The Mixture-of-Experts layer: a router and one fused expert op, reusable by every MoE family.

    x [T, H] --router--> top-k (expert id, weight) per token
             --experts--> out[t] = sum_j weight[t, j] * down_e(silu(gate_e x_t) * up_e x_t),
                          e = id[t, j]

(a family's experts may add a bias per expert to gate/up and to down, and take gpt-oss's
clamped SwiGLU in place of SiLU-mul: `FusedMoE.expert_extras`, which both ops take.)

Expert weights are stacked per layer, so one call covers every expert:

    w13 [E_local, 2 I_local, H]   rows = [ gate | up ] of each expert
    w2  [E_local, H, I_local]

Sharding over a tensor-parallel group of size P (each rank adds its part; one all-reduce):
  * default: every rank holds all E experts, each cut to I / P of its width (gate/up rows,
    down columns), as a dense MLP is cut;
  * expert parallel (`--enable-expert-parallel`): rank r holds experts [r E/P, (r+1) E/P) whole;
    a token's pairs routed elsewhere contribute nothing here.
Either way the router runs replicated on every rank (it is tiny) and picks the same experts.

The experts run through hearth's CPU kernel `moe_experts` when one is attached (tokens grouped by
expert, only the active experts' weights read; quantized experts for few-row steps), else
through `fused_experts_torch`, the reference. Experts kept only in a GGUF's blocks
(`blocks_only`, hearth.models.quant.attach_file_blocks) run every step on the packed path: a
prompt chunk's pairs are spread over the experts (a 512-token chunk of a 128-expert top-8 model
gives each ~32 rows), where qlinear's tiles are as fast as a float GEMM.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hearth.models.arch import ModelArch
from hearth.models.layers import LOWP_MIN_ROWS, QLINEAR_MAX_ROWS, drop_float
from hearth.models.parallel_group import ParallelGroup
from hearth.ops.cpu_kernels import unpack_mxfp4


def route_softmax(logits: torch.Tensor, top_k: int, renormalize: bool
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts in fp32, the top k, optionally renormalised to sum to 1.
    Returns (weights [T, k] float32, expert ids [T, k] int64)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def route_grouped(logits: torch.Tensor, top_k: int, scoring_func: str, topk_method: str,
                  n_group: int, topk_group: int, renormalize: bool, scaling: float,
                  correction_bias: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's router (V2: softmax, greedy or group-limited; V3 / Kimi K2: sigmoid,
    "noaux_tc"), in fp32. Scores by `scoring_func`; with a group method, only experts in the
    `topk_group` best of `n_group` equal groups compete (a group's worth: its best score for
    group_limited_greedy, the sum of its two best biased scores for noaux_tc); noaux_tc picks by
    score + correction bias but weights by the unbiased score. Weights are renormalised to sum to
    1 with `renormalize`, then times `scaling`. Returns (weights [T, k] float32, ids [T, k])."""
    logits = logits.float()
    scores = torch.sigmoid(logits) if scoring_func == "sigmoid" else torch.softmax(logits, -1)
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if topk_method != "greedy" and n_group > 1:
        grouped = choice.view(choice.shape[0], n_group, -1)
        group_scores = (grouped.topk(2, dim=-1)[0].sum(-1) if topk_method == "noaux_tc"
                        else grouped.amax(-1))
        best = torch.topk(group_scores, topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        choice = choice.masked_fill(~keep.repeat_interleave(grouped.shape[2], dim=1),
                                    float("-inf"))
    ids = torch.topk(choice, top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """[n, 2I] rows of [gate | up] -> [n, I], gpt-oss's activation (transformers'
    GptOssExperts._apply_gate): gate <= limit, -limit <= up <= limit,
    (up + 1) * gate * sigmoid(alpha * gate)."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def fused_experts_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                        topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                        expert_start: int = 0, b13: torch.Tensor | None = None,
                        b2: torch.Tensor | None = None,
                        swiglu: tuple[float, float] | None = None) -> torch.Tensor:
    """The expert op in plain torch: the (token, slot) pairs sorted by expert, each active
    expert's gate/up, SiLU-mul and down over its group, combined with the routing weights.
    Experts outside [expert_start, expert_start + E_local) are skipped. Optional biases b13
    [E_local, 2I], b2 [E_local, H] (in the weights' dtype, as F.linear adds them); `swiglu`
    (alpha, limit): `clamped_swiglu` in place of SiLU-mul. Returns [T, H] in x's dtype."""
    num_tokens, top_k = topk_ids.shape
    num_local = w13.shape[0]
    inter = w13.shape[1] // 2
    local = (topk_ids - expert_start).flatten()
    mine = (local >= 0) & (local < num_local)
    order = torch.argsort(local.masked_fill(~mine, num_local), stable=True)
    counts = torch.bincount(local[mine], minlength=num_local).tolist()
    weights = topk_weights.flatten()
    out = torch.zeros(num_tokens, w2.shape[1], dtype=torch.float32, device=x.device)
    b13 = None if b13 is None else b13.to(w13.dtype)
    b2 = None if b2 is None else b2.to(w2.dtype)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start:start + count]
        start += count
        tokens = pairs // top_k
        gate_up = F.linear(x[tokens], w13[expert], None if b13 is None else b13[expert])
        act = (F.silu(gate_up[:, :inter]) * gate_up[:, inter:] if swiglu is None
               else clamped_swiglu(gate_up, *swiglu))
        y = F.linear(act, w2[expert], None if b2 is None else b2[expert])
        out.index_add_(0, tokens, y.float() * weights[pairs, None])
    return out.to(x.dtype)


class FusedMoE(nn.Module):
    """The stacked experts of one layer (this rank's part) and the op that runs them."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 tp: ParallelGroup, expert_parallel: bool) -> None:
        super().__init__()
        self.num_experts, self.group, self.expert_parallel = num_experts, tp, expert_parallel
        if expert_parallel:
            if num_experts % tp.size:
                raise ValueError(f"expert parallel size {tp.size} does not divide "
                                 f"num_experts={num_experts}")
            self.num_local = num_experts // tp.size
            self.expert_start, self.inter = tp.rank * self.num_local, intermediate_size
        else:
            if intermediate_size % tp.size:
                raise ValueError(f"tensor parallel size {tp.size} does not divide the experts' "
                                 f"intermediate size {intermediate_size}")
            self.num_local, self.expert_start = num_experts, 0
            self.inter = intermediate_size // tp.size
        self.w13 = nn.Parameter(torch.empty(self.num_local, 2 * self.inter, hidden_size),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(self.num_local, hidden_size, self.inter),
                               requires_grad=False)
        self.kernels = None  # CpuKernels
        self.w13_lowp = self.w2_lowp = None  # bf16 copies for many-row steps (--prefill-dtype)
        self.lowp_min_rows = LOWP_MIN_ROWS  # steps of more rows than this use the copies
        self.qw13 = self.qw2 = None  # PackedWeight copies for few-row steps (hearth.models.quant)

    def set_lowp_weight(self, dtype: torch.dtype) -> None:
        if self.blocks_only:  # no float stacks: every step runs the packed experts
            return
        self.w13_lowp = self.w13.detach().to(dtype).contiguous()
        self.w2_lowp = self.w2.detach().to(dtype).contiguous()

    def use_lowp_for_prompts(self, dtype: torch.dtype) -> None:
        """Quantized experts only: steps of more than QLINEAR_MAX_ROWS rows run their GEMMs on
        `dtype` copies, fewer rows stay on the packed experts, and the float32 weights are
        dropped (the copies take their place: nothing reads float32 experts any more)."""
        assert self.qw13 is not None, "prompt-only low precision needs the packed experts"
        self.set_lowp_weight(dtype)
        self.lowp_min_rows = QLINEAR_MAX_ROWS
        self.w13.data, self.w2.data = self.w13_lowp, self.w2_lowp

    def set_quantized_experts(self, qw13, qw2, kernels, blocks_only: bool = False) -> None:
        """Packed experts for few-row steps; `blocks_only`: for every step, the float stacks
        dropped (meta stand-ins: a GGUF's expert blocks are the only copy)."""
        self.qw13, self.qw2, self.kernels = qw13, qw2, kernels
        if blocks_only:
            self.w13, self.w2 = drop_float(self.w13), drop_float(self.w2)

    @property
    def blocks_only(self) -> bool:
        return self.w13.is_meta

    def kernel_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The float stacks for the kernel ops, or for blocks-only experts stand-ins of their
        shapes (one float, strides 0): the ops read only their sizes on the packed path."""
        if not self.blocks_only:
            return self.w13, self.w2
        one = torch.zeros(1, 1, 1)
        return one.expand(self.w13.shape), one.expand(self.w2.shape)

    def expert_extras(self) -> dict:
        """What these experts add to down(silu(gate) * up), as keyword arguments of both expert
        ops (`fused_experts_torch`, `CpuKernels.moe_experts`): b13, b2, swiglu. None here;
        gpt-oss's experts have biases and a clamped SwiGLU."""
        return {}

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
        """Partial sums of this rank's experts, [T, H] float32 (x's dtype without kernels)."""
        rows, extras = x.shape[0], self.expert_extras()
        if self.blocks_only and (self.kernels is None or x.device.type != "cpu"):
            # no kernels (MXFP4 blocks loaded by a family): the stacks decoded for this step
            w13 = unpack_mxfp4(self.qw13).view(self.w13.shape).to(x.device)
            w2 = unpack_mxfp4(self.qw2).view(self.w2.shape).to(x.device)
            return fused_experts_torch(x.float(), w13, w2, topk_weights, topk_ids,
                                       self.expert_start, **extras)
        if self.blocks_only:  # every step on the packed experts, in float32 activations
            return self.kernels.moe_experts(x.float(), *self.kernel_weights(), topk_weights,
                                            topk_ids, self.expert_start, self.qw13, self.qw2,
                                            **extras)
        w13, w2 = self.w13, self.w2
        if self.w13_lowp is not None and (x.dtype == self.w13_lowp.dtype
                                          or rows > self.lowp_min_rows):
            w13, w2 = self.w13_lowp, self.w2_lowp
        kernels = self.kernels
        if kernels is None or x.device.type != "cpu":
            return fused_experts_torch(x.to(w13.dtype), w13, w2, topk_weights, topk_ids,
                                       self.expert_start, **extras).to(x.dtype)
        quantized = (self.qw13 is not None and x.dtype == torch.float32
                     and rows <= QLINEAR_MAX_ROWS)
        q13, q2 = (self.qw13, self.qw2) if quantized else (None, None)
        return kernels.moe_experts(x, w13, w2, topk_weights, topk_ids, self.expert_start,
                                   q13, q2, **extras)


def use_lowp_expert_prompts(model: nn.Module, dtype: torch.dtype) -> int:
    """Every MoE layer with packed experts runs prompt-sized steps on `dtype` expert copies in
    place of its float32 ones (`FusedMoE.use_lowp_for_prompts`); returns how many layers."""
    layers = [m for m in model.modules()
              if isinstance(m, FusedMoE) and m.qw13 is not None and not m.blocks_only]
    for experts in layers:
        experts.use_lowp_for_prompts(dtype)
    return len(layers)


class SparseMoeBlock(nn.Module):
    """Router + experts in place of a dense MLP (Mixtral, Qwen3-MoE)."""

    def __init__(self, arch: ModelArch, tp: ParallelGroup, expert_parallel: bool = False) -> None:
        super().__init__()
        moe = arch.moe
        self.top_k, self.renormalize = moe.num_experts_per_tok, moe.norm_topk_prob
        self.gate = nn.Parameter(torch.empty(moe.num_experts, arch.hidden_size),
                                 requires_grad=False)  # the router, replicated
        self.experts = FusedMoE(moe.num_experts, arch.hidden_size,
                                moe.expert_intermediate_size, tp, expert_parallel)
        # Tokens routed to each expert since the runner enabled counting, [num_experts] int64
        # (None: not counted); the runner reports the totals (per-expert load metrics).
        self.expert_counts: torch.Tensor | None = None
        self._no_counts = torch.empty(0, dtype=torch.int64)  # moe_topk's "do not count"

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] float32, expert ids [T, k] int64) of each token; counts the picks."""
        logits = F.linear(x, self.gate.to(x.dtype))
        kernels = self.experts.kernels
        if kernels is not None and x.device.type == "cpu":  # one op: softmax, top-k, counts
            counts = self.expert_counts if self.expert_counts is not None else self._no_counts
            return kernels.moe_topk(logits, self.top_k, self.renormalize, counts)
        topk_weights, topk_ids = route_softmax(logits, self.top_k, self.renormalize)
        self.count(topk_ids)
        return topk_weights, topk_ids

    def count(self, topk_ids: torch.Tensor) -> None:
        if self.expert_counts is not None:
            self.expert_counts += torch.bincount(topk_ids.flatten(),
                                                 minlength=self.expert_counts.numel())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = self.route(x)
        out = self.experts(x, topk_weights, topk_ids)
        out = self.experts.group.all_reduce(out) if self.experts.group.size > 1 else out
        return out.to(x.dtype)

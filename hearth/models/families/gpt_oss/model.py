"""gpt-oss's model: the Llama decoder with gpt-oss's attention and MoE.

Attention (`GptOssAttention`): the Llama attention with biases on q/k/v/o (the arch's
attention_bias / attention_out_bias), RoPE in rotate-half order (as the checkpoint stores it),
and an `AttentionSpec` per layer: the layer's heads' learned sinks, plus a window of
`sliding_window` keys on sliding layers. The backend serves such a spec over only the blocks a
query sees (the CPU kernel backend through its torch path).

MoE (`GptOssMoe`), every layer: a biased router, the top-k logits, a softmax over those; the
experts (`GptOssExperts`) have biases on gate/up and down and a clamped SwiGLU

    gate, up = clamp(x W_gate + b_gate, max=L), clamp(x W_up + b_up, -L, L)
    out      = ((up + 1) * gate * sigmoid(alpha * gate)) W_down + b_down

The checkpoint interleaves gate and up columns; the loader stores them as hearth's [gate | up]
rows. hearth's expert kernel (`moe_experts`) has neither biases nor this activation, so these
experts always run the torch path here (`gpt_oss_experts_torch`), kernels or not, and are never
packed for the kernel's quantized path (`FusedMoE.packable`). No layer takes the fused Llama
decode kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hearth.models.arch import ModelArch
from hearth.models.families.llama.model import LlamaAttention, LlamaForCausalLM
from hearth.models.layers import RotaryEmbedding
from hearth.models.moe import FusedMoE, SparseMoeBlock
from hearth.models.parallel_group import SINGLE, ParallelGroup
from hearth.ops.attention import AttentionSpec
from hearth.ops.attention_backends import AttentionBackend


class GptOssAttention(LlamaAttention):
    def __init__(self, arch: ModelArch, tp: ParallelGroup, rotary: RotaryEmbedding,
                 backend: AttentionBackend, layer: int):
        super().__init__(arch, tp, rotary, backend)
        spec = arch.family_spec
        # [local heads]: this rank's heads' sink logits (the loader cuts them like q's rows)
        self.sinks = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)
        window = spec.sliding_window if spec.sliding_layers[layer] else None
        # holds the Parameter itself: the loaded values and any later dtype cast are seen
        self.spec = AttentionSpec(window=window, sinks=self.sinks)


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """[n, 2I] rows of [gate | up] -> [n, I], as transformers' GptOssExperts._apply_gate."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def gpt_oss_experts_torch(x: torch.Tensor, w13: torch.Tensor, b13: torch.Tensor,
                          w2: torch.Tensor, b2: torch.Tensor | None, topk_weights: torch.Tensor,
                          topk_ids: torch.Tensor, alpha: float, limit: float,
                          expert_start: int = 0) -> torch.Tensor:
    """The experts in plain torch: each active local expert over its (token, slot) pairs,
    combined with the routing weights in float32. w13 [E_local, 2I, H], b13 [E_local, 2I],
    w2 [E_local, H, I], b2 [E_local, H] (None: this rank adds no down bias). Experts outside
    [expert_start, expert_start + E_local) are skipped. Returns [T, H] float32."""
    num_tokens, top_k = topk_ids.shape
    num_local = w13.shape[0]
    local = (topk_ids - expert_start).flatten()
    mine = (local >= 0) & (local < num_local)
    order = torch.argsort(local.masked_fill(~mine, num_local), stable=True)
    counts = torch.bincount(local[mine], minlength=num_local).tolist()
    weights = topk_weights.flatten()
    out = torch.zeros(num_tokens, w2.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start:start + count]
        start += count
        tokens = pairs // top_k
        act = clamped_swiglu(F.linear(x[tokens], w13[expert], b13[expert]), alpha, limit)
        y = F.linear(act, w2[expert], None if b2 is None else b2[expert])
        out.index_add_(0, tokens, y.float() * weights[pairs, None])
    return out


class GptOssExperts(FusedMoE):
    """FusedMoE's stacked experts (same sharding, [gate | up] rows) with gpt-oss's biases:
    b13 [E_local, 2 I_local] cut as w13's rows, b2 [E_local, H] whole. Cut along I (no expert
    parallelism), each rank's down output is a partial sum: only rank 0 adds b2. Never packed
    for the kernel (`packable`): its quantized experts have neither biases nor this SwiGLU."""

    packable = False

    def __init__(self, arch: ModelArch, tp: ParallelGroup, expert_parallel: bool) -> None:
        moe, spec = arch.moe, arch.family_spec
        super().__init__(moe.num_experts, arch.hidden_size, moe.expert_intermediate_size, tp,
                         expert_parallel)
        self.b13 = nn.Parameter(torch.empty(self.num_local, 2 * self.inter), requires_grad=False)
        self.b2 = nn.Parameter(torch.empty(self.num_local, arch.hidden_size), requires_grad=False)
        self.adds_down_bias = expert_parallel or tp.rank == 0
        self.alpha, self.limit = spec.swiglu_alpha, spec.swiglu_limit

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
        """Partial sums of this rank's experts, [T, H] float32; the bf16 copies (--prefill-dtype)
        for steps of bf16 activations or of more than lowp_min_rows rows."""
        w13, w2 = self.w13, self.w2
        if self.w13_lowp is not None and (x.dtype == self.w13_lowp.dtype
                                          or x.shape[0] > self.lowp_min_rows):
            w13, w2 = self.w13_lowp, self.w2_lowp
        return gpt_oss_experts_torch(
            x.to(w13.dtype), w13, self.b13.to(w13.dtype), w2,
            self.b2.to(w2.dtype) if self.adds_down_bias else None, topk_weights, topk_ids,
            self.alpha, self.limit, self.expert_start)


class GptOssMoe(SparseMoeBlock):
    """A biased router (`gate`, `router_bias`): softmax over each token's top-k logits, the
    weights scaling the experts' outputs."""

    def __init__(self, arch: ModelArch, tp: ParallelGroup, expert_parallel: bool = False) -> None:
        super().__init__(arch, tp, expert_parallel)
        self.router_bias = nn.Parameter(torch.empty(arch.moe.num_experts), requires_grad=False)
        self.experts = GptOssExperts(arch, tp, expert_parallel)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.gate.to(x.dtype), self.router_bias.to(x.dtype))
        top_logits, topk_ids = torch.topk(logits.float(), self.top_k, dim=-1)
        self.count(topk_ids)
        return torch.softmax(top_logits, dim=-1), topk_ids


class GptOssForCausalLM(LlamaForCausalLM):
    def __init__(self, arch: ModelArch, tp: ParallelGroup = SINGLE,
                 layer_range: tuple[int, int] | None = None, expert_parallel: bool = False,
                 attn_backend: AttentionBackend | None = None):
        if arch.moe is None or arch.family_spec is None:
            raise ValueError(f"{arch.architecture}: gpt-oss needs its MoE and layer settings")
        self.expert_parallel = expert_parallel  # read by make_mlp during the base __init__
        super().__init__(arch, tp, layer_range, attn_backend)

    def make_mlp(self, layer: int) -> nn.Module:
        return GptOssMoe(self.arch, self.tp, self.expert_parallel)

    def make_attention(self, layer: int, rotary: RotaryEmbedding) -> nn.Module:
        return GptOssAttention(self.arch, self.tp, rotary, self.attn_backend, layer)

    def enable_fused_decode(self) -> bool:
        """Never: the fused kernel has no sinks, windows, biases or these experts."""
        self._fused_all = None
        for layer in self.layers:
            layer._fused = None
        return False

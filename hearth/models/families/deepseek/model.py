"""DeepSeek-V2 / V3 and Kimi K2: multi-head latent attention (MLA) and DeepSeek's MoE.

Attention (`MLAAttention`), per token, with L = kv_lora_rank, R = qk_rope_head_dim:

    [q_c | c | k_pe] = x W_a                  one replicated GEMM (q_a_proj + kv_a_proj_with_mqa)
    q = q_b_proj(norm(q_c))   [H, nope + R]   (or q_proj(x) without a q bottleneck)
    c = kv_a_layernorm(c)     [L]             the latent: what the cache keeps, with rope(k_pe)
    k_h = [c W_UK_h | rope(k_pe)],  v_h = c W_UV_h     (kv_b_proj = [W_UK_h ; W_UV_h] per head)

The paged cache holds one row of L + R values per token and layer (`ModelArch.kv_cache_layout`),
not H heads of K and V. Two ways to attend over it:
  * prompts (more than SHORT_QUERY_MAX new tokens): up-project the context's latents to per-head
    K and V and run flash attention (compute-bound, so the cheaper FLOPs win);
  * short queries (decodes, speculative verify steps): absorb W_UK into the query,
    q_lat_h = [q_nope_h W_UK_h^T | rope(q_pe_h)], attend with all heads over the latent rows
    as one shared key/value head (MQA of width L + R; the value is the first L values), and
    apply W_UV_h to the result: a step reads L + R values per context token, not 2 H heads.
The projections are this module's; the cache write and both attentions are the model's
`AttentionBackend`'s (`write_latent`, `mla_decode`, `mla_prefill`): hearth's CPU kernel reads
the latent rows in place as its one KV head, torch gathers them.

DeepSeek stores the rotary dims of q_pe and k_pe interleaved (pairs (2j, 2j+1)); the loader
permutes those weight rows to the rotate-half layout the rest of hearth uses (the scores are
unchanged: both sides move alike). YaRN's mscale_all_dim scales the softmax (`mla_softmax_scale`).

MoE (`DeepseekMoE`): the router is `route_grouped` (sigmoid + noaux_tc with a score-correction
bias for V3 / K2; softmax, greedy or group-limited for V2), the routed experts are
hearth.models.moe's, and `n_shared_experts` always-on experts are one dense MLP added to them.
The first `first_k_dense_replace` layers have a dense MLP.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from hearth.models.arch import TOPK_METHODS, ModelArch
from hearth.models.layers import (QLINEAR_MAX_ROWS, ColumnParallelLinear, RMSNorm,
                                  RotaryEmbedding, RowParallelLinear)
from hearth.models.families.llama.model import LlamaForCausalLM, LlamaMLP
from hearth.models.moe import SparseMoeBlock, route_grouped
from hearth.models.parallel_group import SINGLE, ParallelGroup
from hearth.ops.attention import AttentionMetadata, build_attention_metadata
from hearth.ops.attention_backends import AttentionBackend
from hearth.ops.cpu_kernels import CpuKernels
from hearth.ops.fused_decode import MlaLayerWeights, MlaShape, MlaStack, ShortQueryStep


def mla_softmax_scale(arch: ModelArch) -> float:
    """qk_head_dim^-1/2, times mscale^2 under YaRN with mscale_all_dim (DeepSeek: the scaled
    RoPE's attention-entropy correction applied to the whole score, not only the rotary part)."""
    scale = arch.mla.qk_head_dim ** -0.5
    scaling = arch.rope_scaling or {}
    if scaling.get("rope_type", "default") != "default" and scaling.get("mscale_all_dim"):
        factor = float(scaling["factor"])
        if factor > 1:
            m = 0.1 * float(scaling["mscale_all_dim"]) * math.log(factor) + 1.0
            scale *= m * m
    return scale


def interleaved_to_half(dim: int) -> torch.Tensor:
    """Row order taking interleaved rotary pairs (2j, 2j+1) to rotate-half pairs (j, j + dim/2)."""
    return torch.cat([torch.arange(0, dim, 2), torch.arange(1, dim, 2)])


class MLAAttention(nn.Module):
    def __init__(self, arch: ModelArch, tp: ParallelGroup, rotary: RotaryEmbedding,
                 backend: AttentionBackend):
        super().__init__()
        mla = arch.mla
        if arch.num_heads % tp.size:
            raise ValueError(f"tensor parallel size {tp.size} does not divide "
                             f"num_heads={arch.num_heads}")
        self.num_heads = arch.num_heads // tp.size
        self.num_kv_heads = 1  # the latent row: one "head" shared by all query heads
        self.nope, self.rope, self.v_dim = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
        self.rank, self.latent_dim, self.q_lora_rank = mla.kv_lora_rank, mla.latent_dim, mla.q_lora_rank
        self.qk_dim = mla.qk_head_dim
        # Projections of x shared by every head (and rank): [q_c |] c | k_pe in one GEMM.
        a_rows = (self.q_lora_rank or 0) + self.latent_dim
        self.qkv_a_proj = ColumnParallelLinear(arch.hidden_size, a_rows, arch.attention_bias, SINGLE)
        if self.q_lora_rank:
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, arch.rms_norm_eps)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, arch.num_heads * self.qk_dim,
                                                 False, tp)
            self.q_proj = None
        else:
            self.q_a_layernorm = self.q_b_proj = None
            self.q_proj = ColumnParallelLinear(arch.hidden_size, arch.num_heads * self.qk_dim,
                                               False, tp)
        self.kv_a_layernorm = RMSNorm(self.rank, arch.rms_norm_eps)
        self.kv_b_proj = ColumnParallelLinear(self.rank, arch.num_heads * (self.nope + self.v_dim),
                                              False, tp)
        self.o_proj = RowParallelLinear(arch.num_heads * self.v_dim, arch.hidden_size, tp,
                                        arch.attention_out_bias)
        self.scale = mla_softmax_scale(arch)
        self.rotary = rotary
        self.backend = backend
        # W_UK_h^T [H L, nope] and W_UV_h [H v, L] in a block format for few-row steps
        # (set_quantized_absorb); kv_b_proj's float weight stays for prompts.
        self.absorb_uk = self.absorb_uv = self.kernels = None

    # -- the up projections, per head ------------------------------------------------------
    def _kv_b(self) -> torch.Tensor:
        return self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.rank)

    def set_quantized_absorb(self, uk, uv, kernels) -> None:
        """The absorbed up-projections as PackedWeights: W_UK_h^T rows [H L, nope] and W_UV_h
        rows [H v, L] (quant_hooks.py `quantize_absorb`)."""
        self.absorb_uk, self.absorb_uv, self.kernels = uk, uv, kernels

    def _absorb(self, x: torch.Tensor, w, rows: int) -> torch.Tensor | None:
        """x [T, H, K] through each head's packed rows (`mla_absorb`, as the fused decode
        layers do), or None where the float weight serves: no packed copy, not float32, or
        more rows than the quantized path takes (the rule of Linear.matmul)."""
        if w is None or x.dtype != torch.float32 or x.shape[0] > QLINEAR_MAX_ROWS:
            return None
        return self.kernels.mla_absorb(x, w, rows)

    def absorb_query(self, q_nope: torch.Tensor) -> torch.Tensor:
        """[T, H, nope] -> [T, H, L]: each head's query through its W_UK (q_nope_h W_UK_h)."""
        out = self._absorb(q_nope, self.absorb_uk, self.rank)
        if out is not None:
            return out
        w_uk = self._kv_b()[:, : self.nope].to(q_nope.dtype)  # [H, nope, L]
        return torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)

    def absorb_output(self, o_lat: torch.Tensor) -> torch.Tensor:
        """[T, H, L] -> [T, H, v]: each head's attended latent through its W_UV."""
        out = self._absorb(o_lat, self.absorb_uv, self.v_dim)
        if out is not None:
            return out
        w_uv = self._kv_b()[:, self.nope:].to(o_lat.dtype)  # [H, v, L]
        return torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)

    def forward(self, x, positions, meta: AttentionMetadata, kv_cache) -> torch.Tensor:
        T, H = x.shape[0], self.num_heads
        a = self.qkv_a_proj(x)
        if self.q_lora_rank:
            q_c, latent = a.split([self.q_lora_rank, self.latent_dim], dim=-1)
            q = self.q_b_proj(self.q_a_layernorm(q_c.contiguous()))
        else:
            latent, q = a, self.q_proj(x)
        q = q.view(T, H, self.qk_dim)
        c, k_pe = latent.split([self.rank, self.rope], dim=-1)
        c = self.kv_a_layernorm(c.contiguous())
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        # RoPE in fp32 (as the dense family and the kernels do), then back to the step's dtype.
        q_pe, k_pe = self.rotary(positions, q_pe.float(), k_pe.float().unsqueeze(1))
        cache = kv_cache[0]  # [num_blocks, block_size, 1, L + R]
        self.backend.write_latent(c, k_pe.squeeze(1), cache, meta)
        q_pe = q_pe.to(q.dtype)
        out = torch.empty(T, H, self.v_dim, dtype=q.dtype, device=x.device)
        if meta.num_short_tokens:
            rows = meta.short_token_index
            if meta.num_short_tokens == T:
                rows = slice(None)
            q_lat = torch.cat([self.absorb_query(q_nope[rows]), q_pe[rows]], dim=-1)
            o_lat = self.backend.mla_decode(q_lat, cache, meta, self.scale, self.rank)
            out[rows] = self.absorb_output(o_lat.to(q.dtype))
        for start, q_len, ctx_len, table in zip(meta.prefill_query_starts, meta.prefill_query_lens,
                                                meta.prefill_context_lens, meta.prefill_block_tables):
            if q_len <= meta.short_max:
                continue  # a short query: done above
            rows = slice(start, start + q_len)
            if self.absorbs_chunk(q_len, ctx_len):
                out[rows] = self._absorbed_chunk(q_nope[rows], q_pe[rows], cache, table, ctx_len)
                continue
            qi = torch.cat([q_nope[rows], q_pe[rows]], dim=-1)
            out[rows] = self._expanded_attention(qi, cache, table, ctx_len)
        return self.o_proj(out.reshape(T, H * self.v_dim))

    # A chunk is absorbed where that costs fewer multiply-adds, weighted by the rates they run
    # at: the absorbed attention's bf16 dot products (or fp32 FMAs) vs the up-projection GEMM
    # and flash attention, ~1.5x apart on the 2-core EPYC of docs/benchmarks.md.
    ABSORBED_SPEEDUP = 1.5
    # The absorbed kernel keeps a partial result (max, sum, output row) per query row, head and
    # context split of 512 tokens: a chunk absorbs only while those stay under this many bytes
    # (DeepSeek-V3's 128 heads of 576 reach it at ~14 new tokens over 16k; decode rows are 1).
    ABSORBED_PARTIAL_BYTES = 128 << 20

    def absorbs_chunk(self, q_len: int, ctx_len: int) -> bool:
        """Whether a prompt chunk of `q_len` new tokens ending a context of `ctx_len` attends
        absorbed (over the latent rows, as decode does) rather than expanded. Expanded costs an
        up-projection of every context row through kv_b_proj, whatever q_len: a later agent turn
        of a few dozen tokens over a 16k prefix spent ~3 s there, ~4x the absorbed cost."""
        H, L, R = self.num_heads, self.rank, self.rope
        if q_len * H * -(-ctx_len // 512) * (L + R + 2) * 4 > self.ABSORBED_PARTIAL_BYTES:
            return False
        absorbed = q_len * ctx_len * H * (2 * L + R) + q_len * H * L * (self.nope + self.v_dim)
        # flash attention pads V to the key width: (nope + R) twice per (query, key)
        expanded = (ctx_len * L * H * (self.nope + self.v_dim)
                    + q_len * (ctx_len - q_len / 2) * H * 2 * (self.nope + R))
        return absorbed < expanded * self.ABSORBED_SPEEDUP

    def _absorbed_chunk(self, q_nope, q_pe, cache, table, ctx_len: int) -> torch.Tensor:
        """A prompt chunk attended as decode steps are (absorbed, over the latent rows in place;
        causal among its own tokens). Returns [q, H, v]."""
        q_len = q_nope.shape[0]
        chunk = build_attention_metadata([q_len], [ctx_len], [table.tolist()], cache.shape[1],
                                         q_nope.device, short_max=q_len)
        q_lat = torch.cat([self.absorb_query(q_nope), q_pe], dim=-1)
        o_lat = self.backend.mla_decode(q_lat, cache, chunk, self.scale, self.rank)
        return self.absorb_output(o_lat.to(q_nope.dtype))

    def _expanded_attention(self, qi: torch.Tensor, cache: torch.Tensor, table: torch.Tensor,
                            ctx_len: int) -> torch.Tensor:
        """A prompt chunk ([q, H, nope + R]) over its context's latents, up-projected to per-head
        K and V (the chunk's own rows read back from the cache, so they are rounded as a later
        step would read them). Returns [q, H, v]."""
        H = self.num_heads
        rows = cache[table].view(-1, self.latent_dim)[:ctx_len]
        c, k_pe = rows[:, : self.rank].to(qi.dtype), rows[:, self.rank:].to(qi.dtype)
        kv = self.kv_b_proj(c).view(ctx_len, H, self.nope + self.v_dim)
        # Flash attention wants one head width for K and V: V is zero-padded to K's.
        k = torch.empty(H, ctx_len, self.qk_dim, dtype=qi.dtype, device=qi.device)
        k[..., : self.nope] = kv[..., : self.nope].transpose(0, 1)
        k[..., self.nope:] = k_pe[None]
        v = qi.new_zeros(H, ctx_len, self.qk_dim)
        v[..., : self.v_dim] = kv[..., self.nope:].transpose(0, 1)
        o = self.backend.mla_prefill(qi.transpose(0, 1), k, v, self.scale)  # [H, q, D]
        return o[..., : self.v_dim].transpose(0, 1)


class DeepseekMoE(SparseMoeBlock):
    """DeepSeek's sparse MLP: grouped router (`route_grouped`), routed experts, shared experts."""

    def __init__(self, arch: ModelArch, tp: ParallelGroup, expert_parallel: bool = False) -> None:
        super().__init__(arch, tp, expert_parallel)
        moe = arch.moe
        self.spec = moe
        # noaux_tc: a learned per-expert bias steering the choice (not the weights)
        self.e_score_correction_bias = (
            nn.Parameter(torch.zeros(moe.num_experts), requires_grad=False)
            if moe.topk_method == "noaux_tc" else None)
        self.shared_experts = (
            LlamaMLP(arch, tp, moe.num_shared_experts * moe.expert_intermediate_size)
            if moe.num_shared_experts else None)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        moe = self.spec
        logits = F.linear(x.float(), self.gate.float())
        weights, ids = route_grouped(logits, self.top_k, moe.scoring_func, moe.topk_method,
                                     moe.n_group, moe.topk_group, moe.norm_topk_prob,
                                     moe.routed_scaling_factor, self.e_score_correction_bias)
        self.count(ids)
        return weights, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x).to(out.dtype)
        return out


class FusedMLAModel(NamedTuple):
    """Every decoder layer of a short-query step as one `mla_decode_layers` kernel call."""

    kernels: CpuKernels
    stack: MlaStack  # the call's fixed arguments (hearth/ops/fused_decode.py)
    moe_blocks: list[DeepseekMoE | None]  # whose expert_counts the router adds to


def fuse_mla_layers(model: "DeepseekV3ForCausalLM") -> FusedMLAModel | None:
    """The fused short-query path's arguments, or None where the kernel does not cover this
    model as built: no CPU kernels, tensor parallelism (the kernel has no all-reduce), a linear
    without packed weights or with a bias, float experts, mixed activation formats."""
    kernels = getattr(model.attn_backend, "kernels", None)
    if (kernels is None or not kernels.has("mla_decode_layers") or model.tp.size > 1
            or not model.layers):
        return None
    layers, blocks, int8 = [], [], set()
    dense_width = shared_width = 0
    first = model.layers[0].self_attn
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        q_linear = attn.q_b_proj if attn.q_lora_rank else attn.q_proj
        dense = mlp if isinstance(mlp, LlamaMLP) else mlp.shared_experts
        linears = [attn.qkv_a_proj, q_linear, attn.o_proj]
        if dense is not None:
            linears += [dense.gate_up_proj, dense.down_proj]
        if (not isinstance(attn, MLAAttention) or any(m.qweight is None or m.bias is not None
                                                      for m in linears)
                or attn.kv_b_proj.weight.dtype != torch.float32):
            return None
        int8.update(m.qweight.int8_act for m in linears)
        router = bias = w13 = w2 = q13 = q2 = None
        if isinstance(mlp, DeepseekMoE):
            experts = mlp.experts
            bias = mlp.e_score_correction_bias
            if (experts.qw13 is None or mlp.gate.dtype != torch.float32
                    or (bias is not None and bias.dtype != torch.float32)):
                return None
            int8.add(experts.qw13.int8_act)
            router, q13, q2 = mlp.gate, experts.qw13, experts.qw2
            w13, w2 = experts.kernel_weights()
            shared_width = dense.inter if dense is not None else 0
            blocks.append(mlp)
        else:
            dense_width = mlp.inter
            blocks.append(None)
        if attn.absorb_uk is not None:
            int8.add(attn.absorb_uk.int8_act)
        layers.append(MlaLayerWeights(
            in_norm=layer.input_layernorm.weight, post_norm=layer.post_attention_layernorm.weight,
            qkv_a=attn.qkv_a_proj.qweight,
            q_a_norm=attn.q_a_layernorm.weight if attn.q_lora_rank else None,
            q=q_linear.qweight, kv_a_norm=attn.kv_a_layernorm.weight,
            kv_b=attn.kv_b_proj.weight.contiguous(), o=attn.o_proj.qweight,
            gate_up=dense.gate_up_proj.qweight if dense is not None else None,
            down=dense.down_proj.qweight if dense is not None else None,
            router=router, router_bias=bias, w13=w13, w2=w2, q13=q13, q2=q2,
            uk=attn.absorb_uk, uv=attn.absorb_uv))
    if len(int8) > 1:
        return None  # 8-bit activations in some linears only: the module path
    spec = model.arch.moe
    experts = next((b.experts for b in blocks if b is not None), None)
    shape = MlaShape(
        num_heads=first.num_heads, qk_nope=first.nope, qk_rope=first.rope, v_head=first.v_dim,
        kv_lora_rank=first.rank, q_lora_rank=first.q_lora_rank or 0,
        top_k=spec.num_experts_per_tok, n_group=spec.n_group, topk_group=spec.topk_group,
        scoring=int(spec.scoring_func == "sigmoid"),
        topk_method=TOPK_METHODS.index(spec.topk_method), renormalize=spec.norm_topk_prob,
        expert_start=experts.expert_start if experts is not None else 0,
        dense_width=dense_width, shared_width=shared_width,
        eps=model.layers[0].input_layernorm.eps, scale=first.scale,
        routed_scaling_factor=spec.routed_scaling_factor)
    stack = MlaStack.pack(layers, shape, first.rotary.cos, first.rotary.sin, int8.pop())
    return FusedMLAModel(kernels, stack, blocks)


class DeepseekV3ForCausalLM(LlamaForCausalLM):
    """DeepSeek-V2 / V3, Kimi K2: the decoder stack of the Llama family with MLA attention and
    DeepSeek's MoE in every layer the arch's `MoeSpec` marks sparse."""

    def __init__(self, arch: ModelArch, tp: ParallelGroup = SINGLE,
                 layer_range: tuple[int, int] | None = None, expert_parallel: bool = False,
                 attn_backend: AttentionBackend | None = None):
        if arch.mla is None or arch.moe is None:
            raise ValueError(f"{arch.architecture}: needs MLA and MoE settings")
        self.expert_parallel = expert_parallel  # read by make_mlp during the base __init__
        super().__init__(arch, tp, layer_range, attn_backend)

    def make_attention(self, layer: int, rotary: RotaryEmbedding) -> nn.Module:
        return MLAAttention(self.arch, self.tp, rotary, self.attn_backend)

    def make_mlp(self, layer: int) -> nn.Module:
        if not self.arch.is_moe_layer(layer):
            return LlamaMLP(self.arch, self.tp)
        return DeepseekMoE(self.arch, self.tp, self.expert_parallel)

    def enable_fused_decode(self) -> bool:
        """Steps of short queries only (decodes, verify steps) run every layer in one
        `mla_decode_layers` kernel call where `fuse_mla_layers` covers the model as built.
        Returns whether they do."""
        self._fused_all = fuse_mla_layers(self)
        return self._fused_all is not None

    def _decode_layers(self, hidden, residual, positions, meta, kv_caches):
        f = self._fused_all
        caches = (kv_caches[:, 0].unbind(0) if isinstance(kv_caches, torch.Tensor)
                  else [kv[0] for kv in kv_caches])
        if caches[0].dtype not in (torch.float32, torch.bfloat16):  # int8 / fp8 rows: modules
            for layer, kv_cache in zip(self.layers, kv_caches):
                hidden, residual = layer(hidden, residual, positions, meta, kv_cache)
            return hidden, residual
        counts = [self._no_counts if b is None or b.expert_counts is None else b.expert_counts
                  for b in f.moe_blocks]
        return f.kernels.mla_decode_layers(f.stack, hidden, residual, caches, counts,
                                           ShortQueryStep.of(meta, positions))

    _no_counts = torch.empty(0, dtype=torch.int64)

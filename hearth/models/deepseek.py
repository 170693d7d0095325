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

import torch
import torch.nn.functional as F
from torch import nn

from hearth.models.arch import ModelArch
from hearth.models.layers import (ColumnParallelLinear, RMSNorm, RotaryEmbedding,
                                  RowParallelLinear)
from hearth.models.llama import LlamaForCausalLM, LlamaMLP
from hearth.models.moe import SparseMoeBlock, route_grouped
from hearth.ops.attention import AttentionMetadata
from hearth.ops.attention_backends import AttentionBackend
from hearth.ops.parallel import SINGLE, ParallelGroup


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

    # -- the up projections, per head ------------------------------------------------------
    def _kv_b(self) -> torch.Tensor:
        return self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.rank)

    def absorb_query(self, q_nope: torch.Tensor) -> torch.Tensor:
        """[T, H, nope] -> [T, H, L]: each head's query through its W_UK (q_nope_h W_UK_h)."""
        w_uk = self._kv_b()[:, : self.nope].to(q_nope.dtype)  # [H, nope, L]
        return torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)

    def absorb_output(self, o_lat: torch.Tensor) -> torch.Tensor:
        """[T, H, L] -> [T, H, v]: each head's attended latent through its W_UV."""
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
            qi = torch.cat([q_nope[start:start + q_len], q_pe[start:start + q_len]], dim=-1)
            out[start:start + q_len] = self._expanded_attention(qi, cache, table, ctx_len)
        return self.o_proj(out.reshape(T, H * self.v_dim))

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

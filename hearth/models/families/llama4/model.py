"""Llama 4's text model: the Llama decoder with Llama 4's attention and MoE.

Attention (`Llama4Attention`, per layer as the arch's `Llama4Spec` says):
  * RoPE layers: q/k weightlessly RMS-normed per head and rotated (the loader put the
    checkpoint's interleaved pairs in rotate-half order; the norm commutes with the rotation),
    chunked-local where the spec says (`AttentionSpec(chunk=...)`: the backend reads only the
    blocks of the query's chunk).
  * NoPE layers: no rotation, full causal attention, queries scaled by the temperature
    1 + attn_scale * log1p(floor((position + 1) / floor_scale)).
MoE layers (`Llama4Moe`): top-k of the router's logits, sigmoid of those (no softmax, no
renormalising), the weight scaling each routed expert's INPUT, plus a shared expert on every
token; dense layers are SiLU MLPs of their own width (the arch's intermediate_size).

No layer takes the fused Llama decode kernel (it knows neither NoPE's temperature nor
chunks nor these experts): every step runs the modules.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hearth.models.arch import ModelArch
from hearth.models.families.llama.model import LlamaAttention, LlamaForCausalLM, LlamaMLP
from hearth.models.layers import RMSNorm, RotaryEmbedding
from hearth.models.moe import SparseMoeBlock
from hearth.models.parallel_group import SINGLE, ParallelGroup
from hearth.ops.attention import AttentionMetadata, AttentionSpec
from hearth.ops.attention_backends import AttentionBackend


def interleaved_to_half(dim: int) -> torch.Tensor:
    """Row order taking interleaved rotary pairs (2j, 2j+1) to rotate-half pairs (j, j + dim/2)."""
    return torch.cat([torch.arange(0, dim, 2), torch.arange(1, dim, 2)])


def attention_temperature(positions: torch.Tensor, floor_scale: float,
                          attn_scale: float) -> torch.Tensor:
    """[T] float32 query scales of NoPE layers, as transformers computes them."""
    return torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0


class Llama4Attention(LlamaAttention):
    def __init__(self, arch: ModelArch, tp: ParallelGroup, rotary: RotaryEmbedding,
                 backend: AttentionBackend, layer: int):
        super().__init__(arch, tp, rotary, backend)
        spec = arch.family_spec
        self.use_rope = spec.rope_layers[layer]
        if self.use_rope and spec.qk_norm:  # weightless: the weights stay ones
            self.q_norm = RMSNorm(self.head_dim, arch.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, arch.rms_norm_eps)
        if spec.chunked_layers[layer]:
            self.spec = AttentionSpec(chunk=spec.attention_chunk_size)
        self.temperature = (None if self.use_rope or not spec.temperature_tuning
                            else (spec.floor_scale, spec.attn_scale))

    def forward(self, x, positions, meta: AttentionMetadata, kv_cache) -> torch.Tensor:
        if self.use_rope:
            return super().forward(x, positions, meta, kv_cache)
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.temperature is not None:
            scale = attention_temperature(positions, *self.temperature)
            q = (q * scale.to(q.device)[:, None, None]).to(q.dtype)
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        self.backend.write_kv(k, v, k_cache, v_cache, meta)
        o = self.backend.attend(q, k, v, k_cache, v_cache, meta, self.scale, self.spec)
        return self.o_proj(o.reshape(-1, self.q_size))


class Llama4Moe(SparseMoeBlock):
    """Llama 4's sparse MLP: routed experts (hearth.models.moe.FusedMoE) fed x * sigmoid(logit)
    for each of the top-k logits, and a shared expert (a SiLU MLP of the experts' width)."""

    def __init__(self, arch: ModelArch, tp: ParallelGroup, expert_parallel: bool = False) -> None:
        super().__init__(arch, tp, expert_parallel)
        moe = arch.moe
        self.shared_experts = LlamaMLP(arch, tp,
                                       moe.num_shared_experts * moe.expert_intermediate_size)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(sigmoid of the top-k logits [T, k] float32, their experts [T, k] int64)."""
        logits = F.linear(x, self.gate.to(x.dtype))
        top, ids = torch.topk(logits, self.top_k, dim=-1)
        self.count(ids)
        return torch.sigmoid(top.float()), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        num_tokens, top_k = ids.shape
        # each (token, pick) pair is one row of input scaled by its weight, run by one expert
        # at weight 1; a token's rows are summed after
        rows = x.repeat_interleave(top_k, 0) if top_k > 1 else x
        rows = (rows * weights.reshape(-1, 1)).to(x.dtype)
        ones = torch.ones(rows.shape[0], 1, dtype=torch.float32, device=x.device)
        out = self.experts(rows, ones, ids.reshape(-1, 1))
        if top_k > 1:
            out = out.view(num_tokens, top_k, -1).sum(1)
        out = self.experts.group.all_reduce(out) if self.experts.group.size > 1 else out
        return self.shared_experts(x) + out.to(x.dtype)


class Llama4ForCausalLM(LlamaForCausalLM):
    def __init__(self, arch: ModelArch, tp: ParallelGroup = SINGLE,
                 layer_range: tuple[int, int] | None = None, expert_parallel: bool = False,
                 attn_backend: AttentionBackend | None = None):
        if arch.moe is None or arch.family_spec is None:
            raise ValueError(f"{arch.architecture}: Llama 4 needs its MoE and layer settings")
        self.expert_parallel = expert_parallel  # read by make_mlp during the base __init__
        super().__init__(arch, tp, layer_range, attn_backend)

    def make_mlp(self, layer: int) -> nn.Module:
        if not self.arch.is_moe_layer(layer):
            return LlamaMLP(self.arch, self.tp)  # intermediate_size_mlp wide
        return Llama4Moe(self.arch, self.tp, self.expert_parallel)

    def make_attention(self, layer: int, rotary: RotaryEmbedding) -> nn.Module:
        return Llama4Attention(self.arch, self.tp, rotary, self.attn_backend, layer)

    def enable_fused_decode(self) -> bool:
        """Never: the fused kernel has no NoPE temperature, chunks or Llama 4 experts."""
        self._fused_all = None
        for layer in self.layers:
            layer._fused = None
        return False

"""The Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2/2.5 with QKV bias, Qwen3 with q/k norm).

Models know only math: `forward(input_ids, positions, attn_metadata, kv_caches)`. Tokens of all
requests in a step are packed into one `[num_tokens]` batch; attention splits them per request,
through the model's one `AttentionBackend` (hearth/ops/attention_backends/), picked when it is
built.
A pipeline stage holds layers [layer_start, layer_end): the first stage embeds, the last one norms
and projects to logits; in between, hidden states and residuals pass through.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from hearth.models.arch import ModelArch
from hearth.models.layers import (KERNEL_ACT_DTYPES, LOWP_MIN_ROWS, QLINEAR_MAX_ROWS,
                                  ColumnParallelLinear, ParallelLMHead, RMSNorm,
                                  RotaryEmbedding, RowParallelLinear, VocabParallelEmbedding)
from hearth.models.parallel_group import SINGLE, ParallelGroup
from hearth.ops.attention import CAUSAL, AttentionMetadata, AttentionSpec
from hearth.ops.attention_backends import (AttentionBackend, TorchAttentionBackend,
                                           select_attention_backend)
from hearth.ops.cpu_kernels import CpuKernels
from hearth.ops.fused_decode import LlamaLayerWeights, LlamaShape, LlamaStack, ShortQueryStep


def local_kv_heads(arch: ModelArch, tp: ParallelGroup) -> int:
    """KV heads per rank: sharded when there are enough, otherwise replicated."""
    return max(1, arch.num_kv_heads // tp.size)


class LlamaAttention(nn.Module):
    def __init__(self, arch: ModelArch, tp: ParallelGroup, rotary: RotaryEmbedding,
                 backend: AttentionBackend):
        super().__init__()
        if arch.num_heads % tp.size:
            raise ValueError(f"tensor parallel size {tp.size} does not divide "
                             f"num_heads={arch.num_heads}")
        self.num_heads = arch.num_heads // tp.size
        self.num_kv_heads = local_kv_heads(arch, tp)
        self.head_dim = arch.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        self.qkv_proj = ColumnParallelLinear(arch.hidden_size, (self.q_size + 2 * self.kv_size)
                                             * tp.size, arch.attention_bias, tp)
        self.o_proj = RowParallelLinear(arch.num_heads * self.head_dim, arch.hidden_size, tp,
                                        arch.attention_out_bias)
        self.q_norm = RMSNorm(self.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.rotary = rotary
        self.backend = backend
        # a sliding window, chunked-local attention or sinks (a family sets them per layer)
        self.spec: AttentionSpec = CAUSAL

    def forward(self, x, positions, meta: AttentionMetadata, kv_cache) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)  # [T, H, D]
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # [T, KVH, D]
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        qk_norm = (None if self.q_norm is None
                   else (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps))
        # One pass where the backend has it: q and k (normed and) rotated in place in qkv, the
        # views above, and k and v in the cache.
        if not self.backend.rope_write_kv(qkv, positions, self.rotary.cos, self.rotary.sin,
                                          k_cache, v_cache, meta, self.num_heads,
                                          self.num_kv_heads, self.head_dim, qk_norm):
            q, k = self.norm_and_rotate(q, k, positions)
            self.backend.write_kv(k, v, k_cache, v_cache, meta)
        o = self.backend.attend(q, k, v, k_cache, v_cache, meta, self.scale, self.spec)
        return self.o_proj(o.reshape(-1, self.q_size))

    def norm_and_rotate(self, q, k, positions) -> tuple[torch.Tensor, torch.Tensor]:
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if q.dtype != self.qkv_proj.weight.dtype:  # bf16 activations of an fp32 model
            dtype = q.dtype  # rotate in fp32, as the kernel does
            q, k = self.rotary(positions, q.float(), k.float())
            return q.to(dtype), k.to(dtype)
        return self.rotary(positions, q, k)


class LlamaMLP(nn.Module):
    """SiLU-gated MLP, cut along its width under tensor parallelism (`intermediate_size`:
    another width than the arch's, e.g. DeepSeek's shared experts)."""

    def __init__(self, arch: ModelArch, tp: ParallelGroup, intermediate_size: int | None = None):
        super().__init__()
        width = intermediate_size or arch.intermediate_size
        self.inter = width // tp.size
        self.gate_up_proj = ColumnParallelLinear(arch.hidden_size, 2 * width, arch.mlp_bias, tp)
        self.down_proj = RowParallelLinear(width, arch.hidden_size, tp, arch.mlp_bias)
        self.kernels = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.kernels is not None and gate_up.dtype in KERNEL_ACT_DTYPES:
            return self.down_proj(self.kernels.silu_mul(gate_up))
        gate, up = gate_up.split([self.inter, self.inter], dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


class FusedDecode(NamedTuple):
    """Layers whose short-query steps run as one `decode_layers` kernel call."""

    kernels: CpuKernels  # the build the layers attend through
    stack: LlamaStack  # the call's fixed arguments


class LlamaDecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, tp: ParallelGroup, rotary: RotaryEmbedding,
                 mlp: nn.Module, attn: nn.Module | None, backend: AttentionBackend):
        super().__init__()
        # LlamaAttention, or a family's own (hearth.models.families.deepseek.model.MLAAttention)
        self.self_attn = attn if attn is not None else LlamaAttention(arch, tp, rotary, backend)
        self.mlp = mlp  # LlamaMLP, or a family's own (hearth.models.moe.SparseMoeBlock)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def enable_fused_decode(self) -> bool:
        """Steps of short queries only (decodes, speculative verify steps: at most 16 tokens in
        all) go through one fused kernel call (`decode_layers` over this layer) when every part is
        one the kernel does: a dense MLP, quantized weights, no biases or q/k norms, plain
        causal attention, one rank. Returns whether it is enabled."""
        attn, mlp = self.self_attn, self.mlp
        if not isinstance(mlp, LlamaMLP) or not isinstance(attn, LlamaAttention):
            self._fused = None
            return False
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        kernels = attn.backend.kernels  # the fused call attends through the same build
        if (kernels is None or attn.q_norm is not None or not attn.spec.is_causal
                or any(m.bias is not None for m in linears)
                or attn.o_proj.group.size > 1 or any(m.qweight is None for m in linears)):
            self._fused = None
            return False
        self._fused = FusedDecode(kernels, LlamaStack.pack(
            [self.fused_weights()], self.fused_shape(), attn.rotary.cos, attn.rotary.sin,
            any(m.qweight.int8_act for m in linears)))
        return True

    def fused_weights(self) -> LlamaLayerWeights:
        attn, mlp = self.self_attn, self.mlp
        return LlamaLayerWeights(
            in_norm=self.input_layernorm.weight, post_norm=self.post_attention_layernorm.weight,
            qkv=attn.qkv_proj.qweight, o=attn.o_proj.qweight, gate_up=mlp.gate_up_proj.qweight,
            down=mlp.down_proj.qweight)

    def fused_shape(self) -> LlamaShape:
        attn = self.self_attn
        return LlamaShape(num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads,
                          head_dim=attn.head_dim, intermediate=self.mlp.inter, scale=attn.scale,
                          eps=self.input_layernorm.eps)

    _fused: FusedDecode | None = None

    def forward(self, x, residual, positions, meta, kv_cache, act_dtype=None):
        """`act_dtype`: the dtype of the normed activations the linears and attention see (None:
        the residual's, float32); the residual stream itself stays in its own dtype. The
        residual is carried separately so a pipeline stage can hand both on."""
        if (self._fused is not None and meta.num_short_tokens == meta.num_tokens
                and x.shape[0] <= QLINEAR_MAX_ROWS and x.dtype == torch.float32
                and act_dtype is None):
            kernels, stack = self._fused
            return kernels.decode_layers(stack, x, residual, [kv_cache[0]], [kv_cache[1]],
                                         ShortQueryStep.of(meta, positions))
        if residual is None:
            residual, normed = x, self.input_layernorm(x, act_dtype)
        else:
            normed, residual = self.input_layernorm.add_forward(x, residual, act_dtype)
        h = self.self_attn(normed, positions, meta, kv_cache)
        normed, residual = self.post_attention_layernorm.add_forward(h, residual, act_dtype)
        return self.mlp(normed), residual


def _stream(hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """The residual stream between layers, as a new float32 tensor (the next layer's fused
    norm updates `residual` in place)."""
    return (hidden.float().clone() if residual is None else (hidden + residual).float())


class LlamaForCausalLM(nn.Module):
    def __init__(self, arch: ModelArch, tp: ParallelGroup = SINGLE,
                 layer_range: tuple[int, int] | None = None,
                 attn_backend: AttentionBackend | None = None):
        """`attn_backend`: what every layer attends through (None: torch on the CPU;
        hearth.models.weights.build_model picks it for the model's device)."""
        super().__init__()
        self.arch = arch
        self.tp = tp
        self.attn_backend = attn_backend or TorchAttentionBackend()
        self.layer_start, self.layer_end = layer_range or (0, arch.num_layers)
        self.is_first = self.layer_start == 0
        self.is_last = self.layer_end == arch.num_layers
        rotary = RotaryEmbedding(arch.rotary_dim, arch.max_position_embeddings, arch.rope_theta,
                                 arch.rope_scaling)
        self.embed_tokens = (VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, tp)
                             if self.is_first else None)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(arch, tp, rotary, self.make_mlp(i), self.make_attention(i, rotary),
                              self.attn_backend)
            for i in range(self.layer_start, self.layer_end))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps) if self.is_last else None
        self.lm_head = (ParallelLMHead(arch.vocab_size, arch.hidden_size, tp)
                        if self.is_last else None)
        # --prefill-dtype bfloat16 (`use_lowp_prefill`): a step of more than LOWP_MIN_ROWS rows
        # keeps its activations in this dtype between the GEMMs (the residual stays fp32).
        self.lowp_dtype = None

    def make_mlp(self, layer: int) -> nn.Module:
        """The feed-forward block of decoder layer `layer` (a family with other MLPs overrides)."""
        return LlamaMLP(self.arch, self.tp)

    def make_attention(self, layer: int, rotary: RotaryEmbedding) -> nn.Module | None:
        """The attention block of decoder layer `layer` (None: LlamaAttention; a family with
        another attention overrides), attending through `self.attn_backend`."""
        return None

    def forward(self, input_ids, positions, meta: AttentionMetadata, kv_caches,
                hidden: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                aux: dict[int, torch.Tensor | None] | None = None):
        """First stage: from ids. Later stages: from (hidden, residual) of the previous stage.
        Returns (hidden, residual); the last stage returns the final normed hidden states.
        `aux` (EAGLE-3 drafting): its keys name layers; each value is set to the residual
        stream entering that layer ([num_tokens, hidden]; key `num_layers`: after the last)."""
        if self.is_first:
            hidden, residual = self.embed_tokens(input_ids), None
        # More rows than LOWP_MIN_ROWS with a bf16 weight copy: the bf16 GEMMs beat the fused
        # qlinear kernel there (see layers.LOWP_MIN_ROWS), short-query steps included.
        act_dtype = self.lowp_dtype if hidden.shape[0] > LOWP_MIN_ROWS else None
        if (self._fused_all is not None and meta.num_short_tokens == meta.num_tokens
                and hidden.shape[0] <= QLINEAR_MAX_ROWS and hidden.dtype == torch.float32
                and act_dtype is None and not aux):
            hidden, residual = self._decode_layers(hidden, residual, positions, meta, kv_caches)
        else:
            for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
                if aux and self.layer_start + i in aux:
                    aux[self.layer_start + i] = _stream(hidden, residual)
                hidden, residual = layer(hidden, residual, positions, meta, kv_cache, act_dtype)
        if aux and self.layer_end in aux:
            aux[self.layer_end] = _stream(hidden, residual)
        if self.is_last:
            return self.norm.add_forward(hidden, residual)[0], None
        return hidden, residual

    _fused_all: FusedDecode | None = None

    def enable_fused_decode(self) -> bool:
        """Fuse each layer's short-query steps (`LlamaDecoderLayer.enable_fused_decode`); when
        all of them are fused, such a step runs every layer in one kernel call
        (`decode_layers`: one Python call per step instead of one per layer). Returns whether
        every layer is fused."""
        self._fused_all = None
        if not all([layer.enable_fused_decode() for layer in self.layers]):
            return False
        fused = [layer._fused for layer in self.layers]
        if not fused or any(f.stack.int8_act != fused[0].stack.int8_act for f in fused):
            return True  # nothing to run, or mixed activation formats: one call per layer
        first = self.layers[0]
        self._fused_all = FusedDecode(fused[0].kernels, LlamaStack.pack(
            [layer.fused_weights() for layer in self.layers], first.fused_shape(),
            first.self_attn.rotary.cos, first.self_attn.rotary.sin, fused[0].stack.int8_act))
        return True

    def _decode_layers(self, hidden, residual, positions, meta, kv_caches):
        kernels, stack = self._fused_all
        if isinstance(kv_caches, torch.Tensor):  # [layers, 2, blocks, ...]: two views per layer
            k_caches, v_caches = kv_caches[:, 0].unbind(0), kv_caches[:, 1].unbind(0)
        else:
            k_caches, v_caches = [kv[0] for kv in kv_caches], [kv[1] for kv in kv_caches]
        return kernels.decode_layers(stack, hidden, residual, k_caches, v_caches,
                                     ShortQueryStep.of(meta, positions))

    def use_kernels(self, kernels) -> None:
        """Route norms, SiLU-mul and MoE experts through `kernels`, and attention (RoPE + cache
        writes included) through the backend `select_attention_backend` picks with them."""
        for module in self.modules():
            if hasattr(module, "kernels") and not hasattr(module, "set_quantized"):
                module.kernels = kernels
        device = next(p for p in self.parameters() if not p.is_meta).device  # not blocks-only
        self.use_attention_backend(select_attention_backend(device, kernels))

    def use_attention_backend(self, backend: AttentionBackend) -> None:
        """Every layer attends through `backend` from now on."""
        self.attn_backend = backend
        for layer in self.layers:
            layer.self_attn.backend = backend

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

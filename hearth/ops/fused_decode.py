"""The fused decode ops' arguments as named structures (csrc/fused_args.h is the C++ half).

A step of short queries only (decodes, speculative verify steps) can run every decoder layer
in one kernel call: `decode_layers` for the Llama family, `mla_decode_layers` for DeepSeek's.
A torch op takes tensors, lists and scalars, so a model's weights cross as one tensor list,
one ggml-type list and one int and one float list. This module keeps that packing in one
place: a model names every field of these frozen dataclasses, `*Stack.pack` flattens them once
when fused decode is enabled, and `CpuKernels.decode_layers` / `mla_decode_layers` call the op
with keyword arguments. The field order of each dataclass is the C++ layout's
(`fused_decode_layout`, checked by tests/unit/test_cpu_kernels.py):

    LlamaLayerWeights -> per layer: tensors [in_norm, post_norm, qkv.qs, qkv.d, qkv.m, ...],
                         types [qkv.qtype, o.qtype, gate_up.qtype, down.qtype]
    LlamaShape        -> dims [num_heads, num_kv_heads, head_dim, intermediate],
                         fdims [scale, eps]

A PackedWeight field is three tensors and one type; an absent tensor or weight (None) is an
empty tensor and type 0.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from hearth.ops.attention import AttentionMetadata
from hearth.ops.cpu_kernels import PackedWeight

_EMPTY = torch.empty(0)


def _flatten(layer) -> tuple[list[torch.Tensor], list[int]]:
    """One layer dataclass's tensors and ggml types in its field order."""
    tensors, types = [], []
    for f in fields(layer):
        value = getattr(layer, f.name)
        if f.type.startswith("PackedWeight"):
            tensors += [_EMPTY] * 3 if value is None else [value.qs, value.d, value.m]
            types.append(0 if value is None else value.qtype)
        else:
            tensors.append(_EMPTY if value is None else value)
    return tensors, types


def _split_shape(shape) -> tuple[list[int], list[float]]:
    """A shape dataclass's int (and bool) fields, then its float fields, each in field order."""
    ints, floats = [], []
    for f in fields(shape):  # annotations are strings here (`from __future__ import annotations`)
        if f.type not in ("int", "bool", "float"):
            raise TypeError(f"{type(shape).__name__}.{f.name}: a shape field is int, bool or float")
        value = getattr(shape, f.name)
        if f.type == "float":
            floats.append(float(value))
        else:
            ints.append(int(value))
    return ints, floats


@dataclass(frozen=True)
class ShortQueryStep:
    """What a fused call reads of the step: the metadata's short-query fields."""

    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [num_short, max_blocks] int32, 0-padded
    context_lens: torch.Tensor  # [num_short] int32
    query_lens: torch.Tensor | None  # [num_short] int32 (None: one token each)

    @classmethod
    def of(cls, meta: AttentionMetadata, positions: torch.Tensor) -> "ShortQueryStep":
        return cls(positions, meta.slot_mapping, meta.short_block_table_i32,
                   meta.short_context_lens, meta.short_query_lens)


# ---- Llama -------------------------------------------------------------------------------


@dataclass(frozen=True)
class LlamaLayerWeights:
    """One Llama decoder layer as `decode_layers` reads it."""

    in_norm: torch.Tensor  # [hidden] float32
    post_norm: torch.Tensor  # [hidden] float32
    qkv: PackedWeight  # [(H + 2 KVH) D, hidden]
    o: PackedWeight  # [hidden, H D]
    gate_up: PackedWeight  # [2 I, hidden]
    down: PackedWeight  # [hidden, I]


@dataclass(frozen=True)
class LlamaShape:
    num_heads: int  # per rank
    num_kv_heads: int
    head_dim: int
    intermediate: int  # the MLP's width I
    scale: float  # softmax scale
    eps: float  # RMS norm epsilon


@dataclass(frozen=True)
class LlamaStack:
    """The fixed arguments of `decode_layers` over some layers, flattened once."""

    weights: list[torch.Tensor]
    qtypes: list[int]
    dims: list[int]
    fdims: list[float]
    rope_cos: torch.Tensor  # [positions, rotary / 2] float32
    rope_sin: torch.Tensor
    int8_act: bool  # 8-bit activations (VNNI) in every linear

    @classmethod
    def pack(cls, layers: list[LlamaLayerWeights], shape: LlamaShape, rope_cos: torch.Tensor,
             rope_sin: torch.Tensor, int8_act: bool) -> "LlamaStack":
        weights, qtypes = [], []
        for layer in layers:
            t, q = _flatten(layer)
            weights += t
            qtypes += q
        dims, fdims = _split_shape(shape)
        return cls(weights, qtypes, dims, fdims, rope_cos, rope_sin, int8_act)


# ---- DeepSeek MLA ------------------------------------------------------------------------


@dataclass(frozen=True)
class MlaLayerWeights:
    """One DeepSeek-V2/V3 / Kimi K2 decoder layer as `mla_decode_layers` reads it (None:
    absent)."""

    in_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv_a: PackedWeight  # [q_c |] c | k_pe
    q_a_norm: torch.Tensor | None  # the q bottleneck's norm (None: no q bottleneck)
    q: PackedWeight  # q_b_proj, or q_proj without a q bottleneck
    kv_a_norm: torch.Tensor
    kv_b: torch.Tensor  # [H (nope + v), L] float32, contiguous
    o: PackedWeight
    gate_up: PackedWeight | None  # the dense MLP, or the shared experts (None: neither)
    down: PackedWeight | None
    router: torch.Tensor | None  # [E, hidden] float32 (None: a dense layer)
    router_bias: torch.Tensor | None  # [E] float32 correction bias
    w13: torch.Tensor | None  # the experts' float weights [E, 2I, H] (their shapes are read)
    w2: torch.Tensor | None  # [E, H, I]
    q13: PackedWeight | None  # the experts' packed rows
    q2: PackedWeight | None
    uk: PackedWeight | None  # W_UK_h^T [H L, nope] packed (None: kv_b's float rows)
    uv: PackedWeight | None  # W_UV_h [H v, L] packed


@dataclass(frozen=True)
class MlaShape:
    num_heads: int
    qk_nope: int
    qk_rope: int
    v_head: int
    kv_lora_rank: int  # L
    q_lora_rank: int  # 0: no q bottleneck
    top_k: int
    n_group: int
    topk_group: int
    scoring: int  # 0 softmax, 1 sigmoid
    topk_method: int  # 0 greedy, 1 group_limited_greedy, 2 noaux_tc
    renormalize: bool
    expert_start: int  # this rank's first expert
    dense_width: int  # the dense MLP's intermediate width
    shared_width: int  # the shared experts' intermediate width
    eps: float
    scale: float
    routed_scaling_factor: float


@dataclass(frozen=True)
class MlaStack:
    """The fixed arguments of `mla_decode_layers` over some layers, flattened once."""

    weights: list[torch.Tensor]
    qtypes: list[int]
    dims: list[int]
    fdims: list[float]
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor
    int8_act: bool

    @classmethod
    def pack(cls, layers: list[MlaLayerWeights], shape: MlaShape, rope_cos: torch.Tensor,
             rope_sin: torch.Tensor, int8_act: bool) -> "MlaStack":
        weights, qtypes = [], []
        for layer in layers:
            t, q = _flatten(layer)
            weights += t
            qtypes += q
        dims, fdims = _split_shape(shape)
        return cls(weights, qtypes, dims, fdims, rope_cos, rope_sin, int8_act)

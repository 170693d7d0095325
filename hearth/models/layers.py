"""Building blocks: RMSNorm, rotary embedding, and tensor-parallel linear layers.

Parallel linears hold only their rank's shard:
  * ColumnParallelLinear splits the output features (each rank computes a slice; no communication);
  * RowParallelLinear splits the input features (partial sums, then one all-reduce);
  * VocabParallelEmbedding splits the vocabulary (masked lookup, then one all-reduce).
`shard_sizes` lets a merged projection (QKV, gate/up) shard each of its parts separately.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from hearth.models.parallel_group import ParallelGroup
from hearth.ops.lowp_gemm import LowpWeight


# A step with at most this many rows multiplies through the quantized weights (decode: bound by
# reading weights); more rows (prefill chunks) go through the float GEMM (bound by FLOPs). The
# crossover, measured over the default model's 120 Q4_1 linears on a 2-core AVX-512 machine
# (with qlinear's 2-row x 8-row tiles): rows 16 / 24 / 32 / 40 / 48 took 22 / 32 / 42 / 52 / 62
# ms through qlinear and 38 / 43 / 49 / 53 / 59 ms through the float GEMM. Verify steps of
# several decoding requests (1 + k rows each) and small chunks beside decodes land in 17-32.
QLINEAR_MAX_ROWS = 32
# With --prefill-dtype bfloat16, steps of more rows than this multiply through the bf16 weight
# copy. On an AMX Xeon (2026-12-02) the 120 linears took, qlinear against bf16 GEMM, 9.2 / 18.2
# ms at 8 rows, 17.0 / 17.3 at 16, 25.5 / 18.2 at 24, 33.7 / 20.7 at 32 (32 streams decoding).
# With the bf16 weights prepacked for oneDNN (lowp_gemm.py), whole decode steps of N streams
# (engine alone, AMX Xeon, 2026-12-06), fused qlinear against bf16: 12.9 / 20.8 ms at 6 streams,
# 17.7 / 21.2 at 8, 25.3 / 23.8 at 12, 35.5 / 25.8 at 16, 50.7 / 32.3 at 24.
LOWP_MIN_ROWS = 10


# With 8-bit activations on the K-quant super-block kernels (the AVX2 builds,
# CpuKernels.kquant_superblock_act), a weight kept only in blocks multiplies through qlinear at
# every row count: from 8 rows qlinear runs an M-blocked integer GEMM (csrc/kquant_gemm.h,
# qlinear_q4k_gemm / qlinear_q6k_gemm: a panel of weight rows unpacked once per step) that beats
# float tiles decoded from the blocks at every M. One thread (2-core AVX2 EPYC, under load,
# thread CPU time; benchmarks/q4k_prefill.py), GOPS at 32 / 128 / 512 rows: Q4_K [14336, 4096]
# 96 / 109 / 92 (decoded float tiles 44 / 62 / 68; the earlier integer tiles 70 / 68 / 67),
# Q6_K [4096, 14336] 89 / 92 / 89 (float 41 / 55 / 60; earlier tiles 55 / 56 / 54).
KQUANT_A8_MAX_ROWS = {12: math.inf, 14: math.inf}  # ggml types Q4_K, Q6_K: no row line

# A many-row step over a weight kept only in blocks multiplies by tiles of it decoded on the
# fly (`dequant_rows`): each tile about this many bytes, decoded once per step and used by all
# of the step's rows.
TILE_BYTES = 4 << 20


def drop_float(param: nn.Parameter) -> nn.Parameter:
    """A stand-in for a weight that lives only in blocks: same shape and dtype, no storage (any
    use of its values is an error, never a silent read of garbage)."""
    return nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device="meta"),
                        requires_grad=False)


class QuantizedWeight:
    """Mixin for linear layers: an optional ggml-block copy of `weight` for few-row steps, and an
    optional bfloat16 copy for steps of more than LOWP_MIN_ROWS rows (`--prefill-dtype
    bfloat16`: AMX tiles make a bf16 GEMM ~15x faster than fp32 on CPUs that have them).
    bf16 activations (a many-row step of a model under `use_lowp_prefill`) go through the bf16
    copy and stay bf16; an fp32 input of many rows (the LM head) is rounded to bf16 and the
    output widened back to fp32.

    A weight packed straight from a GGUF's blocks (`set_quantized(..., blocks_only=True)`) has
    no float copy at all: `weight` is a meta stand-in, few-row steps run qlinear, and many-row
    steps multiply by tiles decoded from the blocks (float32, or bf16 under `use_lowp_prefill`)
    — the same values the float copy held, since the blocks are the file's."""

    qweight = None  # hearth.ops.cpu_kernels.PackedWeight
    kernels = None
    weight_lowp = None  # hearth.ops.lowp_gemm.LowpWeight (bfloat16, packed for oneDNN) or None
    tile_dtype = None  # blocks only: the dtype of many-row steps' tiles (None: float32)
    qlinear_max_rows = QLINEAR_MAX_ROWS  # blocks only: steps up to this many rows run qlinear
    lowp_min_rows = LOWP_MIN_ROWS  # float32 steps of more rows than this use the bf16 copy

    def set_quantized(self, qweight, kernels, blocks_only: bool = False) -> None:
        self.qweight, self.kernels = qweight, kernels
        if blocks_only:
            self.weight = drop_float(self.weight)
            if qweight.int8_act and kernels is not None and kernels.kquant_superblock_act():
                self.qlinear_max_rows = KQUANT_A8_MAX_ROWS.get(qweight.qtype, QLINEAR_MAX_ROWS)

    @property
    def blocks_only(self) -> bool:
        return self.weight.is_meta

    def set_lowp_weight(self, dtype: torch.dtype) -> None:
        if self.blocks_only:  # no float copy to round: tiles are decoded in `dtype`
            self.tile_dtype = dtype
            return
        self.weight_lowp = LowpWeight(self.weight, dtype)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows, fp32 = x.shape[0], x.dtype == torch.float32
        lowp = self.weight_lowp
        if self.blocks_only:
            if fp32 and rows <= self.qlinear_max_rows:
                out = self.kernels.qlinear(x, self.qweight)
            else:
                out = self._tiled_matmul(x)
            return out if bias is None else out + bias.to(out.dtype)
        if lowp is not None and x.dtype == lowp.dtype:  # bf16 activations stay bf16
            out = lowp(x)
            return out if bias is None else out + bias.to(out.dtype)
        if lowp is not None and fp32 and rows > self.lowp_min_rows:
            out = lowp(x.to(lowp.dtype)).float()
        elif self.qweight is not None and fp32 and rows <= QLINEAR_MAX_ROWS:
            out = self.kernels.qlinear(x, self.qweight)
        else:
            return F.linear(x, self.weight, bias)
        return out if bias is None else out + bias

    def _tiled_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T with W decoded from its blocks a tile of rows at a time, in the step's
        dtype (bf16 activations, or fp32 ones under a bf16 tile dtype, multiply bf16 tiles)."""
        w = self.qweight
        dtype = (x.dtype if x.dtype != torch.float32 else self.tile_dtype) or torch.float32
        xin = x if x.dtype == dtype else x.to(dtype)
        tile = max(64, TILE_BYTES // (w.in_features * dtype.itemsize)) // 64 * 64
        out = torch.empty(x.shape[0], w.out_features, dtype=dtype)
        for n0 in range(0, w.out_features, tile):
            n1 = min(n0 + tile, w.out_features)
            part = self.kernels.dequant_rows(w, torch.arange(n0, n1), dtype)
            torch.mm(xin, part.t(), out=out[:, n0:n1])
        return out if x.dtype == dtype else out.to(x.dtype)


def use_lowp_prefill(model: nn.Module, dtype: torch.dtype) -> int:
    """Many-row steps of `model` in `dtype`: every linear layer gets a `dtype` copy of its
    weight, and a model that offers it (`lowp_dtype`) keeps a step's activations in `dtype`
    between its GEMMs when the step has more than LOWP_MIN_ROWS rows (the residual stream stays
    fp32). Returns how many linear layers (and MoE expert stacks) got a copy."""
    layers = [m for m in model.modules() if hasattr(m, "set_lowp_weight")]
    for m in layers:
        m.set_lowp_weight(dtype)
    for m in model.modules():
        if hasattr(m, "lowp_dtype"):
            m.lowp_dtype = dtype
    return len(layers)


def use_lowp_prompt_gemms(model: nn.Module, dtype: torch.dtype,
                          min_rows: int = QLINEAR_MAX_ROWS) -> int:
    """Steps of more than `min_rows` rows run each linear layer's GEMM in `dtype` (its input
    rounded, the output widened back), everything between the GEMMs (norms, attention, SiLU)
    staying float32: for CPUs whose bf16 GEMMs beat fp32 without AMX (AVX512-BF16 on Zen 4:
    ~2x at 64+ rows), where bf16 attention and decode-sized batches do not pay. A float weight
    gets a `dtype` copy, a blocks-only one decodes its many-row tiles in `dtype`. MoE expert
    stacks are `moe.use_lowp_expert_prompts`'s. Returns how many layers take them."""
    layers = [m for m in model.modules() if isinstance(m, QuantizedWeight)]
    for m in layers:
        m.set_lowp_weight(dtype)
        m.lowp_min_rows = min_rows
    return len(layers)


# Activation dtypes the CPU kernels' norms, SiLU-mul and RoPE read and write.
KERNEL_ACT_DTYPES = (torch.float32, torch.bfloat16)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps
        self.kernels = None  # CpuKernels: one fused pass instead of six torch ops

    def _kernel_ok(self, x: torch.Tensor) -> bool:
        return (self.kernels is not None and x.dtype in KERNEL_ACT_DTYPES
                and self.weight.dtype == torch.float32 and x.device.type == "cpu")

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """norm(x) * weight, in `out_dtype` (default: x's dtype)."""
        out_dtype = out_dtype or x.dtype
        if self._kernel_ok(x) and out_dtype in KERNEL_ACT_DTYPES:
            return self.kernels.rms_norm(x, self.weight, self.eps, out_dtype == torch.bfloat16)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x.to(dtype)).to(out_dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor,
                    out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x) in `out_dtype` (default: the residual's), residual + x); the
        fused kernel updates `residual` in place."""
        out_dtype = out_dtype or residual.dtype
        if (self._kernel_ok(x) and residual.dtype == torch.float32 and residual.is_contiguous()
                and out_dtype in KERNEL_ACT_DTYPES):
            return self.kernels.add_rms_norm(x, residual, self.weight, self.eps,
                                             out_dtype == torch.bfloat16), residual
        residual = residual + x
        return self(residual, out_dtype), residual


class ColumnParallelLinear(QuantizedWeight, nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, group: ParallelGroup):
        super().__init__()
        assert out_features % group.size == 0, (out_features, group.size)
        self.group = group
        self.weight = nn.Parameter(torch.empty(out_features // group.size, in_features),
                                   requires_grad=False)
        self.bias = (nn.Parameter(torch.zeros(out_features // group.size), requires_grad=False)
                     if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class RowParallelLinear(QuantizedWeight, nn.Module):
    def __init__(self, in_features: int, out_features: int, group: ParallelGroup,
                 bias: bool = False):
        super().__init__()
        assert in_features % group.size == 0, (in_features, group.size)
        self.group = group
        self.weight = nn.Parameter(torch.empty(out_features, in_features // group.size),
                                   requires_grad=False)
        # Whole on every rank, added once after the all-reduce.
        self.bias = (nn.Parameter(torch.zeros(out_features), requires_grad=False)
                     if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.group.all_reduce(self.matmul(x))
        return out if self.bias is None else out + self.bias.to(out.dtype)


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, dim: int, group: ParallelGroup):
        super().__init__()
        self.group = group
        self.shard = math.ceil(vocab_size / group.size)
        self.start = group.rank * self.shard
        self.weight = nn.Parameter(torch.empty(self.shard, dim), requires_grad=False)
        self.packed = None  # the table in blocks (set_packed): rows decoded as looked up
        self.packed_kernels = None

    def set_packed(self, packed, kernels) -> None:
        """Keep the table only in `packed` (a PackedWeight of [vocab, dim]; one rank)."""
        self.packed, self.packed_kernels = packed, kernels
        self.weight = drop_float(self.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            rows = self.packed_kernels.dequant_rows(self.packed, ids.reshape(-1))
            return rows.view(*ids.shape, -1)
        if self.group.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.shard)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside[:, None], 0.0)
        return self.group.all_reduce(out)


class ParallelLMHead(QuantizedWeight, nn.Module):
    """Vocab-parallel output projection; `forward` returns full-vocab logits on every rank."""

    def __init__(self, vocab_size: int, dim: int, group: ParallelGroup):
        super().__init__()
        self.group = group
        self.vocab_size = vocab_size
        self.shard = math.ceil(vocab_size / group.size)
        self.weight = nn.Parameter(torch.empty(self.shard, dim), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.matmul(hidden)
        return self.group.all_gather_last_dim(logits)[:, : self.vocab_size]


def _rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (and the attention-scale factor yarn asks for) per rope_scaling type,
    as transformers' ROPE_INIT_FUNCTIONS compute them (tests/model/test_hf_parity.py). The types
    are those in hearth.models.arch.ROPE_TYPES; the arch refuses any other at load."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type in ("default", None):
        return inv_freq, 1.0
    factor = float(scaling["factor"])
    if rope_type == "linear":
        return inv_freq / factor, 1.0
    if rope_type == "llama3":
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        return torch.where(mid, blended, scaled), 1.0
    if rope_type == "yarn":
        old_len = scaling.get("original_max_position_embeddings", 4096)
        beta_fast, beta_slow = scaling.get("beta_fast", 32), scaling.get("beta_slow", 1)

        def dim_for(rot: float) -> float:
            return head_dim * math.log(old_len / (rot * 2 * math.pi)) / (2 * math.log(theta))

        low, high = dim_for(beta_fast), dim_for(beta_slow)
        if scaling.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        if low == high:
            high += 0.001  # as transformers does: no zero-width ramp
        ramp = (torch.arange(head_dim // 2, dtype=torch.float64, device="cpu") - low) / (high - low)
        extrapolate = 1 - ramp.clamp(0, 1)
        inv = inv_freq / factor * (1 - extrapolate) + inv_freq * extrapolate
        return inv, _yarn_attention_factor(scaling, factor)
    raise ValueError(f"unsupported rope_scaling type {rope_type!r}")


def _yarn_attention_factor(scaling: dict, factor: float) -> float:
    """cos/sin scale: `attention_factor` if given, else 0.1 ln(factor) + 1 (DeepSeek's
    mscale/mscale_all_dim variant: the ratio of two such terms)."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])

    def mscale(weight: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * weight * math.log(factor) + 1.0

    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return mscale(scaling["mscale"]) / mscale(scaling["mscale_all_dim"])
    return mscale(1.0)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE (HF layout) from a precomputed cos/sin table indexed by position."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None):
        super().__init__()
        inv_freq, mscale = _rope_inv_freq(head_dim, theta, scaling)
        # Computed on the CPU even under a meta-device context: the meta path of arange costs ~1 s
        # of one-time setup in torch, a third of a cold start.
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float64, device="cpu"), inv_freq)
        self.register_buffer("cos", (freqs.cos() * mscale).float(), persistent=False)
        self.register_buffer("sin", (freqs.sin() * mscale).float(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        # q: [T, H, D], k: [T, KVH, D]; cos/sin: [T, 1, D/2]
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """[x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin], written into one output (no cat: on a
    2k-token prefill the concatenating version cost twice as much)."""
    half = x.shape[-1] // 2
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    out = torch.empty_like(x)
    out1, out2 = out[..., :half], out[..., half:]
    torch.mul(x1, cos, out=out1)
    out1.addcmul_(x2, sin, value=-1)
    torch.mul(x2, cos, out=out2)
    out2.addcmul_(x1, sin)
    return out

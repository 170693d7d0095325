"""The scaled KV cache formats (`--kv-cache-dtype int8|fp8`): each K or V row carries its own scale.

A cache of dtype torch.int8 or torch.float8_e4m3fn holds, per token and KV head, `head_dim`
8-bit values followed by the 4 bytes of one float32 scale, so its last dimension is
`head_dim + SCALE_BYTES`:

    one row (head_dim 64):  | q0 q1 ... q63 | scale: float32 |   68 bytes (bf16: 128)
                            value j = q_j * scale

Symmetric, one scale per (token, head): scale = max|x| / QMAX (int8: 127; fp8 e4m3: 448, its
largest finite value), q = x / scale rounded half to even (int8: to an integer; fp8: to e4m3's
3 mantissa bits, so the relative step stays ~1/16 of each value down to 2^-6 of the row's
largest, where int8's step is a fixed 1/127 of the largest). Why per row and not per block: a
row is quantized once, when its token is written, so a block never needs rescaling as tokens
arrive one at a time, and a token's numbers do not depend on the other tokens of its block: a
prompt in one chunk or several, a prefix hit, a PD import and a tier load all read the same
K/V. Why inside the row: everything that moves whole blocks (PD transfer, KV tiers,
`block_view`) moves the scales with their values, with no second tensor.

The CPU kernels (`rope_write_kv`, `decode_attention`, `prefill_attention` in
csrc/cpu_kernels.cpp) do the same arithmetic, bit for bit on the write side (float32 division,
round half to even), and widen in registers as rows stream in: the dot product runs on the
widened values and the row's scale multiplies the score (K) or the probability (V).
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4  # one float32 scale at the end of every int8 / fp8 row
# The scaled formats: cache dtype -> the largest magnitude a stored value takes.
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
_TINY = torch.finfo(torch.float32).tiny  # an all-zero row divides by this, not by 0


def is_scaled(kv_dtype: torch.dtype) -> bool:
    """Whether rows of `kv_dtype` carry a scale (int8, fp8 e4m3)."""
    return kv_dtype in QMAX


def scale_bytes(kv_dtype: torch.dtype) -> int:
    """Bytes each (token, head) row carries beside its values."""
    return SCALE_BYTES if is_scaled(kv_dtype) else 0


def row_width(head_dim: int, kv_dtype: torch.dtype) -> int:
    """The cache's last dimension for rows of `head_dim` values in `kv_dtype`."""
    return head_dim + scale_bytes(kv_dtype)


def quantize(x: torch.Tensor, kv_dtype: torch.dtype = torch.int8) -> torch.Tensor:
    """[..., D] float -> [..., D + 4] rows of `kv_dtype` (values, then the scale's bytes)."""
    qmax = QMAX[kv_dtype]
    xf = x.float()
    scale = xf.abs().amax(-1, keepdim=True) / qmax  # [..., 1]
    q = (xf / scale.clamp_min(_TINY)).clamp_(-qmax, qmax)
    q = q.round_() if kv_dtype == torch.int8 else q  # (fp8: the cast rounds half to even)
    # as bytes: torch's CPU ops do not all take float8 tensors
    rows = torch.cat([q.to(kv_dtype).view(torch.uint8), scale.view(torch.uint8)], -1)
    return rows.view(kv_dtype)


def dequantize(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., D + 4] int8 / fp8 rows -> [..., D] values (computed in float32, then cast to `dtype`)."""
    raw = rows.view(torch.uint8)
    scale = raw[..., -SCALE_BYTES:].contiguous().view(torch.float32)  # [..., 1]
    return (rows[..., :-SCALE_BYTES].float() * scale).to(dtype)


def to_cache(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """K or V rows [..., D] as the cache stores them."""
    if is_scaled(cache_dtype):
        return x if x.dtype == cache_dtype else quantize(x, cache_dtype)
    return x.to(cache_dtype)


def widen(cache_rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows read back as `dtype` values [..., D]."""
    if is_scaled(cache_rows.dtype):
        return dequantize(cache_rows, dtype)
    return cache_rows.to(dtype)


def as_cached(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """x rounded as a cache of `cache_dtype` holds it, in x's dtype (a prompt attending to its
    own fresh keys reads the numbers every later step will read)."""
    if cache_dtype in (x.dtype, torch.float32):
        return x
    return widen(to_cache(x, cache_dtype), x.dtype)


def copy_rows(cache: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> None:
    """cache[slots] = rows along the first dimension (as bytes for fp8: torch's CPU index_copy_
    has no float8 kernel)."""
    if cache.dtype == torch.float8_e4m3fn:
        cache, rows = cache.view(torch.uint8), rows.view(torch.uint8)
    cache.index_copy_(0, slots, rows)

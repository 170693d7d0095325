"""The int8 KV cache format (`--kv-cache-dtype int8`): each K or V row carries its own scale.

A cache of dtype torch.int8 holds, per token and KV head, `head_dim` int8 values followed by the
4 bytes of one float32 scale, so its last dimension is `head_dim + SCALE_BYTES`:

    one row (head_dim 64):  | q0 q1 ... q63 | scale: float32 |   68 bytes (bf16: 128)
                            value j = q_j * scale

Symmetric, one scale per (token, head): scale = max|x| / 127, q = round-half-even(x / scale).
Why per row and not per block: a row is quantized once, when its token is written, so a block
never needs rescaling as tokens arrive one at a time, and a token's numbers do not depend on the
other tokens of its block: a prompt in one chunk or several, a prefix hit, a PD import and a
tier load all read the same K/V. Why inside the row: everything that moves whole blocks (PD
transfer, KV tiers, `block_view`) moves the scales with their values, with no second tensor.

The CPU kernels (`rope_write_kv`, `decode_attention`, `prefill_attention` in
csrc/cpu_kernels.cpp) do the same arithmetic, bit for bit on the write side (float32 division,
round half to even), and dequantize in registers as rows stream in: the dot product runs on the
widened int8 values and the row's scale multiplies the score (K) or the probability (V).
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4  # one float32 scale at the end of every int8 row
QMAX = 127
_TINY = torch.finfo(torch.float32).tiny  # an all-zero row divides by this, not by 0


def scale_bytes(kv_dtype: torch.dtype) -> int:
    """Bytes each (token, head) row carries beside its values."""
    return SCALE_BYTES if kv_dtype == torch.int8 else 0


def row_width(head_dim: int, kv_dtype: torch.dtype) -> int:
    """The cache's last dimension for rows of `head_dim` values in `kv_dtype`."""
    return head_dim + scale_bytes(kv_dtype)


def quantize(x: torch.Tensor) -> torch.Tensor:
    """[..., D] float -> [..., D + 4] int8 rows (values, then the scale's bytes)."""
    xf = x.float()
    scale = xf.abs().amax(-1, keepdim=True) / QMAX  # [..., 1]
    q = torch.round(xf / scale.clamp_min(_TINY)).clamp_(-QMAX, QMAX).to(torch.int8)
    return torch.cat([q, scale.view(torch.int8)], -1)


def dequantize(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., D + 4] int8 rows -> [..., D] values (computed in float32, then cast to `dtype`)."""
    scale = rows[..., -SCALE_BYTES:].contiguous().view(torch.float32)  # [..., 1]
    return (rows[..., :-SCALE_BYTES].float() * scale).to(dtype)


def to_cache(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """K or V rows [..., D] as the cache stores them."""
    if cache_dtype == torch.int8:
        return x if x.dtype == torch.int8 else quantize(x)
    return x.to(cache_dtype)


def widen(cache_rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows read back as `dtype` values [..., D]."""
    if cache_rows.dtype == torch.int8:
        return dequantize(cache_rows, dtype)
    return cache_rows.to(dtype)


def as_cached(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """x rounded as a cache of `cache_dtype` holds it, in x's dtype (a prompt attending to its
    own fresh keys reads the numbers every later step will read)."""
    if cache_dtype in (x.dtype, torch.float32):
        return x
    return widen(to_cache(x, cache_dtype), x.dtype)

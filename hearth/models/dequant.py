"""Vectorized torch dequantizers for ggml block formats.

Invariant: `dequantize(raw, ggml_type, shape)` returns exactly what `gguf.quants.dequantize` returns
for the same bytes (bit-for-bit in float32), as a fresh contiguous float32 tensor of `shape`.
tests/unit/test_dequant.py holds it to that, and checks every format against a second, independent
reference written from the ggml block layouts (the only check that means anything for the formats
dequantized through gguf's own code).

Every format stores a row (the last, contiguous dimension) as whole blocks, so a slice of rows is
a slice of bytes: callers may pass only the rows they need. Each block is viewed as one row of a
`[num_blocks, block_bytes]` uint8 matrix; scales are fp16 fields inside it, read with a dtype view
(no copy). The hot formats (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K, MXFP4) write their float32 output
once, into a buffer the caller may give (`out`: a model parameter, so no temporary and no
second copy), and finish in place with float `mul_`/`add_` (vectorized; mixed-dtype `addcmul`
is several times slower, and numpy rounds `d * q + m` the same two-step way). A handful of
rarer formats fall back to gguf's numpy reference (correct, slower).
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT

QK_K = 256  # elements per k-quant super-block


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 field at byte `start` of every block, as float32. # [num_blocks, 1]"""
    return blocks[:, start : start + 2].view(torch.float16).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[n, k] bytes -> [n, 2, k] uint8: low nibbles first, then high nibbles (ggml's order).
    (uint8 out: a bitwise op writing float directly takes a slow casting path, ~10x.)"""
    out = torch.empty(packed.shape[0], 2, packed.shape[1], dtype=torch.uint8)
    torch.bitwise_and(packed, 0x0F, out=out[:, 0])
    torch.bitwise_right_shift(packed, 4, out=out[:, 1])
    return out


def _q8_0(blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    # block (34 B): d fp16 | 32 x int8.  x = d * q
    out.copy_(blocks[:, 2:].view(torch.int8))
    return out.mul_(_f16(blocks, 0))


def _q4_0(blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    # block (18 B): d fp16 | 16 B nibbles.  x = d * (q - 8); elements 0..15 low nibbles, 16..31 high.
    out.copy_(_nibbles(blocks[:, 2:]).view(-1, 32))
    return out.sub_(8).mul_(_f16(blocks, 0))  # q - 8 is exact in float32


def _q4_1(blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    # block (20 B): d fp16 | m fp16 | 16 B nibbles.  x = d * q + m
    out.copy_(_nibbles(blocks[:, 4:]).view(-1, 32))
    return out.mul_(_f16(blocks, 0)).add_(_f16(blocks, 2))


def _k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: 12 bytes -> eight 6-bit scales and eight 6-bit mins per super-block.

        bytes 0-3:  EEaaaaaa   (a: scale j=0..3, E: high 2 bits of scale j+4)
        bytes 4-7:  FFbbbbbb   (b: min j=0..3,   F: high 2 bits of min j+4)
        bytes 8-11: ffffeeee   (e: low 4 bits of scale j+4, f: low 4 bits of min j+4)
    """
    p = packed.reshape(-1, 3, 4)
    sc_lo, mn_lo, mixed = p[:, 0], p[:, 1], p[:, 2]
    scales = torch.cat([sc_lo & 0x3F, (mixed & 0x0F) | ((sc_lo >> 2) & 0x30)], dim=1)
    mins = torch.cat([mn_lo & 0x3F, (mixed >> 4) | ((mn_lo >> 2) & 0x30)], dim=1)
    return scales, mins  # [num_blocks, 8] each, uint8


def _q4_k(blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    # block (144 B): d fp16 | dmin fp16 | 12 B scales | 128 B nibbles.
    # Sub-block s (32 elements) = x = d*sc[s]*q - dmin*mn[s]; bytes 32j..32j+31 hold sub-blocks
    # 2j (low nibbles) and 2j+1 (high nibbles).
    num_blocks = blocks.shape[0]
    scales, mins = _k_scales(blocks[:, 4:16])
    d = (_f16(blocks, 0) * scales).unsqueeze(-1)  # [num_blocks, 8, 1]
    dm = (_f16(blocks, 2) * mins).unsqueeze(-1)
    q = out.view(num_blocks, 8, 32)
    q.copy_(_nibbles(blocks[:, 16:].reshape(-1, 32)).view(num_blocks, 8, 32))
    return q.mul_(d).sub_(dm)


def _q6_k(blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    # block (210 B): ql 128 B (low 4 bits) | qh 64 B (high 2 bits) | 16 x int8 scales | d fp16.
    # Each 128-element half h uses ql[64h:64h+64] and qh[32h:32h+32]:
    #   elements  0..31: ql[0:32] low  | qh bits 0-1      elements 64..95:  ql[0:32] high  | qh bits 4-5
    #   elements 32..63: ql[32:64] low | qh bits 2-3      elements 96..127: ql[32:64] high | qh bits 6-7
    num_blocks = blocks.shape[0]
    ql = _nibbles(blocks[:, :128].reshape(-1, 64)).view(num_blocks, 2, 2, 2, 32)  # [n, h, nib, half, 32]
    qh = blocks[:, 128:192].reshape(num_blocks, 2, 1, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)
    qh = ((qh >> shifts) & 0x03).view(num_blocks, 2, 2, 2, 32)  # [n, h, nib, half, 32]
    q = (ql | (qh << 4)).sub_(32).view(torch.int8).view(num_blocks, 16, 16)  # wraps to [-32, 31]
    d = (blocks[:, 192:208].view(torch.int8) * _f16(blocks, 208)).unsqueeze(-1)  # [n, 16, 1]
    return torch.mul(q, d, out=out.view(num_blocks, 16, 16))


# e2m1 codes doubled (ggml's kvalues_mxfp4), the block scale halved to match
_MXFP4_VALUES = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12],
                             dtype=torch.float32)


def _mxfp4(blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    # block (17 B): e uint8 (e8m0) | 16 B nibbles.  x = 2^(e - 128) * kvalues[q]; elements
    # 0..15 low nibbles, 16..31 high. The scale is built from its bits as ggml's
    # ggml_e8m0_to_fp32_half does (e < 2: a subnormal), so no exp2 rounding or flushing.
    e = blocks[:, :1].to(torch.int32)  # [num_blocks, 1]
    bits = torch.where(e < 2, torch.tensor(0x00200000, dtype=torch.int32) << e, (e - 1) << 23)
    codes = _nibbles(blocks[:, 1:]).view(-1, 32)
    torch.index_select(_MXFP4_VALUES, 0, codes.view(-1).long(), out=out.view(-1))
    return out.mul_(bits.view(torch.float32))


_BLOCK_DEQUANTIZERS = {
    QT.Q8_0: _q8_0,
    QT.Q4_0: _q4_0,
    QT.Q4_1: _q4_1,
    QT.Q4_K: _q4_k,
    QT.Q6_K: _q6_k,
    QT.MXFP4: _mxfp4,  # gpt-oss's experts (llama.cpp's converter keeps OpenAI's blocks)
}
_FLOAT_DTYPES = {QT.F32: torch.float32, QT.F16: torch.float16, QT.BF16: torch.bfloat16}
# Correct via gguf's numpy reference; rare in the wild for Llama-family checkpoints.
_REFERENCE_ONLY = (QT.Q5_0, QT.Q5_1, QT.Q2_K, QT.Q3_K, QT.Q5_K)

SUPPORTED_TYPES: tuple[str, ...] = tuple(
    t.name for t in (*_FLOAT_DTYPES, *_BLOCK_DEQUANTIZERS, *_REFERENCE_ONLY)
)


def is_supported(ggml_type: int) -> bool:
    return ggml_type in _FLOAT_DTYPES or ggml_type in _BLOCK_DEQUANTIZERS or ggml_type in _REFERENCE_ONLY


def dequantize(raw: torch.Tensor, ggml_type: int, shape: tuple[int, ...],
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Raw uint8 bytes of a ggml tensor -> float32 tensor of `shape` (torch order).

    With `out` (a contiguous float32 tensor of `shape`) the values are written there and `out`
    is returned. Without it, F32 gives a view of `raw` (zero copy) and every other type a fresh
    tensor. Raises ValueError for a type without a dequantizer.
    """
    qtype = QT(ggml_type)
    if out is not None and (out.dtype != torch.float32 or not out.is_contiguous()
                            or tuple(out.shape) != tuple(shape)):
        raise ValueError(f"dequantize: out must be contiguous float32 of shape {tuple(shape)}, "
                         f"got {out.dtype} {tuple(out.shape)}")
    if qtype in _FLOAT_DTYPES:
        values = raw.view(_FLOAT_DTYPES[qtype]).view(shape)
        if out is not None:
            return out.copy_(values)
        return values if qtype == QT.F32 else values.float()
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    blocks = raw.view(-1, type_size)
    if out is None:
        out = torch.empty(shape, dtype=torch.float32)
    if qtype in _BLOCK_DEQUANTIZERS:
        _BLOCK_DEQUANTIZERS[qtype](blocks, out.view(-1, block_size))
        return out
    if qtype in _REFERENCE_ONLY:
        from gguf.quants import dequantize as reference_dequantize

        values = reference_dequantize(blocks.numpy(), qtype)
        return out.copy_(torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).view(shape))
    raise ValueError(f"ggml type {qtype.name} is not supported (supported: {', '.join(SUPPORTED_TYPES)})")

"""hearth's dequantizers against two references: an independent one written here from the
ggml block layouts (ggml-quants.c, `dequantize_row_*`), element by element in float64, and gguf's
numpy code, which the torch paths must match bit for bit.

The independent reference matters most for Q5_0/Q5_1/Q2_K/Q3_K/Q5_K: hearth dequantizes those
*through* gguf's numpy code, so comparing them with gguf alone could never fail.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT
from gguf.quants import dequantize as reference_dequantize, quantize as reference_quantize

from hearth.models.dequant import dequantize, is_supported

# Byte offsets of the fp16 fields inside one block of each format.
FP16_FIELDS = {
    QT.Q8_0: (0,),
    QT.Q4_0: (0,),
    QT.Q4_1: (0, 2),
    QT.Q5_0: (0,),
    QT.Q5_1: (0, 2),
    QT.Q2_K: (80, 82),
    QT.Q3_K: (108,),
    QT.Q4_K: (0, 2),
    QT.Q5_K: (0, 2),
    QT.Q6_K: (208,),
}


def make_raw_blocks(qtype: QT, num_rows: int, row_len: int, seed: int = 0) -> np.ndarray:
    """Random block bytes (every quant bit pattern is legal) with finite fp16 scales.

    # [num_rows, row_len // block_size * type_size] uint8
    """
    rng = np.random.default_rng(seed)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    num_blocks = num_rows * row_len // block_size
    raw = rng.integers(0, 256, size=(num_blocks, type_size), dtype=np.uint8)
    for start in FP16_FIELDS[qtype]:
        scales = rng.standard_normal(num_blocks).astype(np.float16) * np.float16(0.01)
        raw[:, start : start + 2] = scales.view(np.uint8).reshape(num_blocks, 2)
    return raw.reshape(num_rows, -1)


# ---- the independent reference: one block at a time, as ggml-quants.c reads it -----------------


def f16(block: np.ndarray, at: int) -> float:
    return float(block[at : at + 2].view(np.float16)[0])


def scale_min_k4(j: int, q: np.ndarray) -> tuple[int, int]:
    """ggml's get_scale_min_k4: sub-block j's 6-bit scale and min from the 12 packed bytes."""
    if j < 4:
        return int(q[j]) & 63, int(q[j + 4]) & 63
    return ((int(q[j + 4]) & 0xF) | ((int(q[j - 4]) >> 6) << 4),
            (int(q[j + 4]) >> 4) | ((int(q[j]) >> 6) << 4))


def ref_q8_0(b):  # d | qs[32] int8
    return f16(b, 0) * b[2:].view(np.int8).astype(np.float64)


def ref_q4_0(b):  # d | qs[16]: element j = low nibble of qs[j], element j + 16 = high nibble
    qs = b[2:].astype(np.int64)
    return f16(b, 0) * (np.concatenate([qs & 0xF, qs >> 4]) - 8)


def ref_q4_1(b):  # d | m | qs[16]
    qs = b[4:].astype(np.int64)
    return f16(b, 0) * np.concatenate([qs & 0xF, qs >> 4]) + f16(b, 2)


def _q5_values(qh: int, qs: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1: 5-bit values; bit j of qh is element j's high bit, bit j + 16 element j + 16's."""
    out = np.empty(32, dtype=np.int64)
    for j in range(16):
        out[j] = (int(qs[j]) & 0xF) | (((qh >> j) & 1) << 4)
        out[j + 16] = (int(qs[j]) >> 4) | (((qh >> (j + 16)) & 1) << 4)
    return out


def ref_q5_0(b):  # d | qh[4] (little-endian uint32) | qs[16];  x = d * (q - 16)
    return f16(b, 0) * (_q5_values(int(b[2:6].view("<u4")[0]), b[6:]) - 16)


def ref_q5_1(b):  # d | m | qh[4] | qs[16];  x = d * q + m
    return f16(b, 0) * _q5_values(int(b[4:8].view("<u4")[0]), b[8:]) + f16(b, 2)


def ref_q2_k(b):  # scales[16] | qs[64] | d | dmin
    scales, qs, d, dmin = b[:16], b[16:80], f16(b, 80), f16(b, 82)
    out, sub = [], 0
    for half in range(2):  # 128 elements from 32 bytes of qs, four 2-bit planes
        q = qs[32 * half : 32 * half + 32]
        for shift in (0, 2, 4, 6):
            for part in (q[:16], q[16:]):
                sc = int(scales[sub])
                sub += 1
                out += [d * (sc & 0xF) * ((int(x) >> shift) & 3) - dmin * (sc >> 4) for x in part]
    return np.array(out)


def ref_q3_k(b):  # hmask[32] | qs[64] | scales[12] | d;  x = d * (scale - 32) * (q - 4 * !hbit)
    hmask, qs, packed, d = b[:32], b[32:96], b[96:108], f16(b, 108)
    scales = []
    for j in range(16):  # 16 six-bit scales: low 4 bits from bytes 0-7, high 2 bits from 8-11
        low = (int(packed[j % 8]) >> (4 * (j // 8))) & 0xF
        high = (int(packed[8 + j % 4]) >> (2 * (j // 4))) & 3
        scales.append((low | high << 4) - 32)
    out, sub, bit = [], 0, 0
    for half in range(2):
        q = qs[32 * half : 32 * half + 32]
        for shift in (0, 2, 4, 6):
            for offset in (0, 16):
                for l in range(16):
                    value = (int(q[offset + l]) >> shift) & 3
                    high_set = (int(hmask[offset + l]) >> bit) & 1
                    out.append(d * scales[sub] * (value - (0 if high_set else 4)))
                sub += 1
            bit += 1
    return np.array(out)


def ref_q4_k(b):  # d | dmin | scales[12] | qs[128]
    d, dmin, packed, qs = f16(b, 0), f16(b, 2), b[4:16], b[16:]
    out = []
    for chunk in range(4):  # 64 elements: low nibbles (sub-block 2c), then high nibbles (2c + 1)
        q = qs[32 * chunk : 32 * chunk + 32].astype(np.int64)
        for sub, values in ((2 * chunk, q & 0xF), (2 * chunk + 1, q >> 4)):
            sc, mn = scale_min_k4(sub, packed)
            out += list(d * sc * values - dmin * mn)
    return np.array(out)


def ref_q5_k(b):  # d | dmin | scales[12] | qh[32] | qs[128]
    d, dmin, packed, qh, qs = f16(b, 0), f16(b, 2), b[4:16], b[16:48].astype(np.int64), b[48:]
    out = []
    for chunk in range(4):
        q = qs[32 * chunk : 32 * chunk + 32].astype(np.int64)
        for sub, values in ((2 * chunk, q & 0xF), (2 * chunk + 1, q >> 4)):
            sc, mn = scale_min_k4(sub, packed)
            out += list(d * sc * (values + 16 * ((qh >> sub) & 1)) - dmin * mn)
    return np.array(out)


def ref_q6_k(b):  # ql[128] | qh[64] | scales[16] int8 | d
    ql, qh, scales, d = b[:128].astype(np.int64), b[128:192].astype(np.int64), b[192:208].view(np.int8), f16(b, 208)
    out = np.empty(256)
    for half in range(2):
        lo, hi, sc = ql[64 * half : 64 * half + 64], qh[32 * half : 32 * half + 32], scales[8 * half :]
        for l in range(32):
            quads = ((lo[l] & 0xF) | ((hi[l] >> 0) & 3) << 4, (lo[l + 32] & 0xF) | ((hi[l] >> 2) & 3) << 4,
                     (lo[l] >> 4) | ((hi[l] >> 4) & 3) << 4, (lo[l + 32] >> 4) | ((hi[l] >> 6) & 3) << 4)
            for k, q in enumerate(quads):  # elements l, l + 32, l + 64, l + 96 of this half
                out[128 * half + 32 * k + l] = d * int(sc[l // 16 + 2 * k]) * (q - 32)
    return out


LAYOUT_REFERENCE = {QT.Q8_0: ref_q8_0, QT.Q4_0: ref_q4_0, QT.Q4_1: ref_q4_1, QT.Q5_0: ref_q5_0,
                    QT.Q5_1: ref_q5_1, QT.Q2_K: ref_q2_k, QT.Q3_K: ref_q3_k, QT.Q4_K: ref_q4_k,
                    QT.Q5_K: ref_q5_k, QT.Q6_K: ref_q6_k}


def layout_dequantize(raw: np.ndarray, qtype: QT) -> np.ndarray:
    """[rows, row_bytes] uint8 -> [rows, row_len] float64, block by block."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    blocks = raw.reshape(-1, type_size)
    values = np.concatenate([LAYOUT_REFERENCE[qtype](block) for block in blocks])
    return values.reshape(raw.shape[0], -1)


@pytest.mark.parametrize("qtype", list(FP16_FIELDS), ids=lambda t: t.name)
def test_random_blocks_match_the_block_layout(qtype: QT) -> None:
    raw = make_raw_blocks(qtype, num_rows=2, row_len=512, seed=3)
    actual = dequantize(torch.from_numpy(raw.reshape(-1)), qtype, (2, 512))
    expected = layout_dequantize(raw, qtype)
    assert np.abs(expected).max() > 0.1  # scales and quants are really exercised
    # float32 result vs float64 arithmetic: rounding only (a wrong bit or offset is O(scale))
    np.testing.assert_allclose(actual.numpy(), expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("qtype", list(FP16_FIELDS), ids=lambda t: t.name)
def test_random_blocks_match_gguf_bit_for_bit(qtype: QT) -> None:
    raw = make_raw_blocks(qtype, num_rows=6, row_len=512)
    expected = reference_dequantize(raw, qtype)
    actual = dequantize(torch.from_numpy(raw.reshape(-1)), qtype, (6, 512))
    assert actual.dtype == torch.float32 and actual.shape == (6, 512)
    np.testing.assert_array_equal(actual.numpy(), expected)


@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q4_0, QT.Q4_1], ids=lambda t: t.name)
def test_quantized_weights_round_trip(qtype: QT) -> None:
    weights = np.random.default_rng(1).standard_normal((8, 64)).astype(np.float32)
    raw = reference_quantize(weights, qtype)
    actual = dequantize(torch.from_numpy(raw.reshape(-1)), qtype, (8, 64))
    np.testing.assert_array_equal(actual.numpy(), reference_dequantize(raw, qtype))
    # and the quantization itself is sane: 4-bit error stays well under the weight scale
    assert np.abs(actual.numpy() - weights).max() < 0.5


def test_a_slice_of_rows_is_a_slice_of_bytes() -> None:
    raw = make_raw_blocks(QT.Q4_K, num_rows=4, row_len=256)
    full = dequantize(torch.from_numpy(raw.reshape(-1)), QT.Q4_K, (4, 256))
    rows = dequantize(torch.from_numpy(raw[1:3].reshape(-1)), QT.Q4_K, (2, 256))
    assert torch.equal(rows, full[1:3])


@pytest.mark.parametrize(
    "qtype,dtype", [(QT.F32, np.float32), (QT.F16, np.float16)], ids=["F32", "F16"]
)
def test_float_types(qtype: QT, dtype: type) -> None:
    values = np.random.default_rng(2).standard_normal((3, 5)).astype(dtype)
    actual = dequantize(torch.from_numpy(values.view(np.uint8).reshape(-1)), qtype, (3, 5))
    np.testing.assert_array_equal(actual.numpy(), values.astype(np.float32))


def test_bf16() -> None:
    values = torch.randn(4, 6).to(torch.bfloat16)
    actual = dequantize(values.view(torch.uint8).reshape(-1), QT.BF16, (4, 6))
    assert torch.equal(actual, values.float())


def test_unsupported_type_is_a_value_error() -> None:
    assert not is_supported(QT.IQ2_XXS)
    with pytest.raises(ValueError, match="IQ2_XXS"):
        dequantize(torch.zeros(66, dtype=torch.uint8), QT.IQ2_XXS, (256,))


@pytest.mark.parametrize("qtype", [QT.F32, QT.F16, *FP16_FIELDS], ids=lambda t: t.name)
def test_out_gets_the_same_values_in_place(qtype: QT) -> None:
    # The loader decodes straight into rows of a merged parameter: same bits, nothing else written.
    if qtype in FP16_FIELDS:
        raw = torch.from_numpy(make_raw_blocks(qtype, num_rows=3, row_len=256, seed=5).reshape(-1))
    else:
        dtype = np.float32 if qtype == QT.F32 else np.float16
        values = np.random.default_rng(5).standard_normal((3, 256)).astype(dtype)
        raw = torch.from_numpy(values.view(np.uint8).reshape(-1))
    expected = dequantize(raw, qtype, (3, 256))
    param = torch.full((5, 256), 7.0)
    assert dequantize(raw, qtype, (3, 256), out=param[1:4]).data_ptr() == param[1:4].data_ptr()
    assert torch.equal(param[1:4], expected)
    assert torch.equal(param[0], torch.full((256,), 7.0)) and torch.equal(param[4], param[0])


def test_out_of_the_wrong_shape_or_dtype_is_refused() -> None:
    raw = torch.from_numpy(make_raw_blocks(QT.Q8_0, num_rows=2, row_len=64).reshape(-1))
    for out in (torch.empty(2, 32), torch.empty(2, 64, dtype=torch.float16), torch.empty(64, 2).t()):
        with pytest.raises(ValueError, match="out must be contiguous float32"):
            dequantize(raw, QT.Q8_0, (2, 64), out=out)


def ref_mxfp4(b):  # e (e8m0) | qs[16]: element j = low nibble of qs[j], j + 16 = high nibble
    e2m1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
    qs = b[1:].astype(np.int64)
    codes = np.concatenate([qs & 0xF, qs >> 4])
    return 2.0 ** (int(b[0]) - 127) * np.array([e2m1[q] for q in codes])


def test_mxfp4_matches_gguf_bit_for_bit_and_the_block_layout() -> None:
    """Every scale byte (2^-127 subnormals to 2^127) and every nibble."""
    rng = np.random.default_rng(7)
    raw = rng.integers(0, 256, size=(256, 17), dtype=np.uint8)
    raw[:, 0] = np.arange(256)
    actual = dequantize(torch.from_numpy(raw.reshape(-1)), QT.MXFP4, (8, 32 * 32))
    np.testing.assert_array_equal(actual.numpy(),
                                  reference_dequantize(raw.reshape(8, -1), QT.MXFP4))
    expected = np.concatenate([ref_mxfp4(block) for block in raw]).reshape(8, -1)
    with np.errstate(over="ignore"):  # 2^127 * 12 is past float32 in either
        np.testing.assert_array_equal(actual.numpy(), expected.astype(np.float32))
    weights = rng.standard_normal((4, 64)).astype(np.float32)
    packed = reference_quantize(weights, QT.MXFP4)
    out = torch.empty(4, 64)
    dequantize(torch.from_numpy(packed.reshape(-1)), QT.MXFP4, (4, 64), out=out)
    assert np.abs(out.numpy() - weights).max() < 1.0  # 4-bit e2m1, a power-of-two scale

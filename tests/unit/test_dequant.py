"""hearth's torch dequantizers agree bit-for-bit with gguf's numpy reference."""

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


@pytest.mark.parametrize("qtype", list(FP16_FIELDS), ids=lambda t: t.name)
def test_random_blocks_match_reference(qtype: QT) -> None:
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

"""MXFP4 (ggml type 39: 32 e2m1 values and a power-of-two exponent byte per block) in the CPU
kernels' packed layout, against gguf's own dequantization (gguf.quants.MXFP4): qlinear at every
tile shape with float32 activations (the weights exact, only summation order differs) and
8-bit ones, dequant_rows bit for bit, requantize_q8_0, the experts op, and transformers'
interleaved nibble order (the layout OpenAI's gpt-oss folders store) repacked to the same
weight."""

import numpy as np
import pytest
import torch

from hearth.models.moe import fused_experts_torch, route_softmax
from hearth.models.quant import quantize_q8_0
from hearth.ops.cpu_kernels import MXFP4, pack_ggml, pack_mxfp4, unpack_mxfp4
from tests.unit.test_cpu_kernels import kernels, quantize_activations  # noqa: F401 (fixture)

gguf_quants = pytest.importorskip("gguf.quants")


def make_mxfp4_blocks(n: int, k: int, gen, low_exponents: bool = False) -> torch.Tensor:
    """Random ggml MXFP4 rows [n, k/32 * 17] uint8 (exponent byte, then 16 nibble bytes);
    exponents around 2^0 (with `low_exponents` some rows' blocks are 0 and 1: subnormal
    scales)."""
    nb = k // 32
    exponents = torch.randint(124, 132, (n, nb, 1), generator=gen, dtype=torch.uint8)
    if low_exponents:
        exponents[0] = torch.randint(0, 2, (nb, 1), generator=gen, dtype=torch.uint8)
    nibbles = torch.randint(0, 256, (n, nb, 16), generator=gen, dtype=torch.uint8)
    return torch.cat([exponents, nibbles], -1).reshape(n, nb * 17)


def gguf_values(blocks: torch.Tensor) -> torch.Tensor:
    """gguf-py's dequantization of ggml MXFP4 rows, [n, k] float32."""
    n = blocks.shape[0]
    values = gguf_quants.MXFP4.dequantize_blocks(blocks.reshape(-1, 17).numpy())
    return torch.from_numpy(np.ascontiguousarray(values)).reshape(n, -1)


def test_dequant_rows_are_gguf_values_bit_for_bit(kernels):
    gen = torch.Generator().manual_seed(0)
    blocks = make_mxfp4_blocks(21, 256, gen, low_exponents=True)
    weight = gguf_values(blocks)
    w = pack_ggml(MXFP4, blocks)
    assert w.qs.shape == (21, 128) and w.m.shape == (21, 8) and w.d.numel() == 0  # 4.25 bits
    assert torch.equal(kernels.dequant_rows(w, torch.arange(21)), weight)
    assert torch.equal(unpack_mxfp4(w), weight)  # the torch decode (no kernels)
    rows = torch.tensor([20, 0, 3, 3])
    assert torch.equal(kernels.dequant_rows(w, rows, torch.bfloat16), weight[rows].bfloat16())
    assert torch.equal(kernels.requantize_q8_0(w), quantize_q8_0(weight))


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 16, 17])
@pytest.mark.parametrize("int8_act", [False, True], ids=["f32", "a8"])
@pytest.mark.parametrize("k", [288, 96, 2880])
def test_qlinear_equals_gguf_dequantized_matmul(kernels, rows, int8_act, k):
    """Every tile shape (1-8 activation rows, leftovers, 4-row groups and the odd rows after),
    70 weight rows (groups of 4 and two left over), 9, 3 or 90 blocks per row (the int8 tile's
    groups of 8 blocks and the 1, 3 or 2 after them: gpt-oss's 2880); with 8-bit activations
    the reference quantizes x per 32-block as the build does."""
    gen = torch.Generator().manual_seed(rows)
    n = 70
    blocks = make_mxfp4_blocks(n, k, gen)
    weight = gguf_values(blocks)
    x = torch.randn(rows, k, generator=gen)
    got = kernels.qlinear(x, pack_ggml(MXFP4, blocks, int8_act=int8_act))
    want = (quantize_activations(x) if int8_act else x) @ weight.T
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * want.abs().max().item())


def test_interleaved_nibbles_repack_to_the_same_weight(kernels):
    """transformers' order (byte j: elements 2j, 2j + 1; value e2m1 * 2^(scale - 127)) gives
    the same packed bytes as ggml's blocks of the same values."""
    gen = torch.Generator().manual_seed(4)
    blocks = make_mxfp4_blocks(6, 128, gen).reshape(6, 4, 17)
    exponents, ggml_nibbles = blocks[..., 0], blocks[..., 1:]
    codes = torch.cat([ggml_nibbles & 0x0F, ggml_nibbles >> 4], -1)  # [6, 4, 32] element order
    hf_nibbles = codes[..., 0::2] | (codes[..., 1::2] << 4)
    got = pack_mxfp4(hf_nibbles, exponents, interleaved=True)
    want = pack_ggml(MXFP4, blocks.reshape(6, -1))
    assert torch.equal(got.qs, want.qs) and torch.equal(got.m, want.m)
    with pytest.raises(ValueError, match="do not match"):
        pack_mxfp4(hf_nibbles[:, :3], exponents)


@pytest.mark.parametrize("int8_act", [False, True], ids=["f32", "a8"])
@pytest.mark.parametrize("num_tokens", [1, 6])
def test_mxfp4_experts_with_biases_equal_reference(kernels, int8_act, num_tokens):
    """The experts op on MXFP4 stacks, with gpt-oss's biases and clamped SwiGLU."""
    E, H, I = 4, 64, 96
    gen = torch.Generator().manual_seed(num_tokens)
    b13_blocks = make_mxfp4_blocks(E * 2 * I, H, gen)
    b2_blocks = make_mxfp4_blocks(E * H, I, gen)
    w13 = gguf_values(b13_blocks).reshape(E, 2 * I, H) / 128  # gate/up O(1): the clamp cuts some
    w2 = gguf_values(b2_blocks).reshape(E, H, I) / 128
    q13 = pack_ggml(MXFP4, b13_blocks, int8_act)
    q2 = pack_ggml(MXFP4, b2_blocks, int8_act)
    q13.m.sub_(7)  # the same values / 128: exponents 7 lower
    q2.m.sub_(7)
    x = torch.randn(num_tokens, H, generator=gen)
    weights, ids = route_softmax(torch.randn(num_tokens, E, generator=gen), 2, True)
    b13, b2 = torch.randn(E, 2 * I, generator=gen), torch.randn(E, H, generator=gen)
    extras = dict(b13=b13, b2=b2, swiglu=(1.702, 1.5))
    want = fused_experts_torch(x, w13, w2, weights, ids, **extras)
    got = kernels.moe_experts(x, w13, w2, weights, ids, 0, q13, q2, **extras)
    tol = 0.05 if int8_act else 1e-4
    torch.testing.assert_close(got, want, atol=tol * want.abs().max().item(), rtol=0)


@pytest.mark.parametrize("int8_act", [False, True], ids=["f32", "a8"])
def test_experts_with_many_pairs_take_decoded_tiles(kernels, int8_act):
    """A prompt-sized step on blocks-only experts: experts with many pairs multiply by float
    tiles decoded from the blocks (the same values, float32 activations: exact), the others by
    the packed tiles; both equal the reference on gguf's values. "Many" is more than 32 pairs
    with float32 activations, more than 256 with 8-bit ones (the int8 pairs tile is as fast as
    a decoded GEMM up to there)."""
    E, H, I = 4, 64, 96
    gen = torch.Generator().manual_seed(9)
    w13_blocks, w2_blocks = make_mxfp4_blocks(E * 2 * I, H, gen), make_mxfp4_blocks(E * H, I, gen)
    q13, q2 = pack_ggml(MXFP4, w13_blocks, int8_act), pack_ggml(MXFP4, w2_blocks, int8_act)
    q13.m.sub_(7)  # gguf's values / 128 (gate/up O(1))
    q2.m.sub_(7)
    w13 = gguf_values(w13_blocks).reshape(E, 2 * I, H) / 128
    w2 = gguf_values(w2_blocks).reshape(E, H, I) / 128
    many = 256 if int8_act else 32
    num_tokens = 300 if int8_act else 70
    x = torch.randn(num_tokens, H, generator=gen)
    logits = torch.randn(num_tokens, E, generator=gen)
    logits[:, 3] -= 2  # expert 3 gets few pairs: the packed tiles
    if int8_act:
        logits[:, 0] += 3  # expert 0 gets most tokens: decoded tiles even with 8-bit activations
        logits[:5, 3] += 10  # and expert 3 a few
    top_k = 1 if int8_act else 2
    weights, ids = route_softmax(logits, top_k, True)
    counts = torch.bincount(ids.flatten(), minlength=E)
    decoded_experts = counts > many
    assert decoded_experts.any() and 0 < counts[3] <= many
    extras = dict(b13=torch.randn(E, 2 * I, generator=gen), b2=torch.randn(E, H, generator=gen),
                  swiglu=(1.702, 1.5))
    want = fused_experts_torch(x, w13, w2, weights, ids, **extras)
    got = kernels.moe_experts(x, w13, w2, weights, ids, 0, q13, q2, **extras)
    tol = 0.05 if int8_act else 1e-4
    torch.testing.assert_close(got, want, atol=tol * want.abs().max().item(), rtol=0)
    # the tokens routed only to decoded experts are exact (float32 activations)
    decoded = decoded_experts[ids].all(-1)
    assert decoded.any()
    torch.testing.assert_close(got[decoded], want[decoded],
                               atol=1e-4 * want.abs().max().item(), rtol=0)

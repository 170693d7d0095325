"""hearth's compiled CPU kernels against the plain-torch math they replace, every build usable here.

The kernels are built by `make setup` (hearth/ops/build_kernels.py). A build the CPU cannot run is
marked unusable by its probe and skipped here; on CI's machines at least one build must load, so
`test_some_build_is_usable` fails rather than skipping everything silently.
"""

import os

import pytest
import torch
import torch.nn.functional as F

from hearth.models.dequant import dequantize
from hearth.models.layers import RotaryEmbedding
from hearth.models.quant import quantize_q8_0
from hearth.ops import kv_quant
from hearth.ops.attention import build_attention_metadata, write_kv
from hearth.ops.attention_backends import CpuKernelAttentionBackend
from hearth.ops.cpu_kernels import QTYPE_IDS, available_variants, load_cpu_kernels, pack_ggml
from hearth.ops.fused_decode import LlamaLayerWeights, LlamaShape, LlamaStack
from tests.attention_steps import paged_attention

VARIANTS = available_variants()
SCALED_KV = [torch.int8, torch.float8_e4m3fn]  # rows of 8-bit values + a float32 scale (kv_quant)
CACHE_DTYPES = [torch.float32, torch.bfloat16, *SCALED_KV]


def test_some_build_is_usable():
    if os.environ.get("HEARTH_ALLOW_NO_KERNELS"):
        pytest.skip("HEARTH_ALLOW_NO_KERNELS set")
    assert VARIANTS, "no CPU kernel build is usable: run `make setup` (hearth/ops/build_kernels.py)"


# One build per process (torch.ops holds one library named `hearth`): this process tests the
# best build; tests/model/test_kernel_builds.py runs this file again for each other one.
TESTED = os.environ.get("HEARTH_TEST_KERNEL_VARIANT") or (VARIANTS[0] if VARIANTS else None)
# The kernels split work over torch's threads (`threads` <= their count). A `make test` worker
# keeps to its share of the cores (tests/conftest.py: one thread on the 2-core box), so the
# tests of the multi-threaded paths ask for every core (`all_threads`) and the rest run on the
# calling thread.
ALL_THREADS = pytest.mark.usefixtures("all_threads")


@pytest.fixture(scope="module")
def kernels():
    if TESTED is None:
        pytest.skip("no CPU kernel build is usable here")
    k = load_cpu_kernels(TESTED)
    assert k.variant == TESTED
    return k




def make_q4_blocks(n: int, k: int, with_min: bool, gen) -> torch.Tensor:
    """Random ggml Q4_0/Q4_1 blocks: [n, k/32 * (18|20)] uint8."""
    nb = k // 32
    d = (torch.rand(n, nb, 1, generator=gen) * 0.1 + 0.01).half()
    parts = [d.view(torch.uint8).reshape(n, nb, 2)]
    if with_min:
        m = (torch.randn(n, nb, 1, generator=gen) * 0.05).half()
        parts.append(m.view(torch.uint8).reshape(n, nb, 2))
    parts.append(torch.randint(0, 256, (n, nb, 16), generator=gen, dtype=torch.uint8))
    return torch.cat(parts, -1).reshape(n, -1).contiguous()


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 15, 16, 17])  # every tile shape
def test_qlinear_equals_dequantized_matmul(kernels, fmt, rows):
    gen = torch.Generator().manual_seed(rows)
    n, k = 70, 96  # n not a multiple of the 4-row tile
    if fmt == "q8_0":
        blocks = quantize_q8_0(torch.randn(n, k, generator=gen))
    else:
        blocks = make_q4_blocks(n, k, fmt == "q4_1", gen)
    qtype = QTYPE_IDS[fmt]
    weight = dequantize(blocks.reshape(-1), qtype, (n, k))
    x = torch.randn(rows, k, generator=gen)
    got = kernels.qlinear(x, pack_ggml(qtype, blocks))
    torch.testing.assert_close(got, x @ weight.T, rtol=1e-5, atol=1e-5)


def quantize_activations(x: torch.Tensor, span: int = 32) -> torch.Tensor:
    """The kernels' 8-bit activations, dequantized: per `span`-element block dx = max|x| / 127,
    q = round(x * 127 / max|x|) (span 256: Q4_K's super-blocks on AVX2 without VNNI)."""
    blocks = x.reshape(x.shape[0], -1, span)
    amax = blocks.abs().amax(-1, keepdim=True)
    # a tensor over a tensor: torch takes `127.0 / amax` as 127 * (1 / amax), an ulp off the
    # kernels' float 127 / amax, which moves ties (x = -7.5 over max 15: -63.500004 against
    # -63.499996) where a block's max is not 127 / 8 (a VNNI build's 32-element blocks)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    return ((blocks * inv).round() * (amax / 127.0)).reshape(x.shape)


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0"])
@pytest.mark.parametrize("rows", [1, 2, 4, 7, 16])
@pytest.mark.parametrize("k", [96, 576])  # an odd number of 32-blocks (3), and an even one
def test_qlinear_int8_activations_equal_quantized_matmul(kernels, fmt, rows, k):
    gen = torch.Generator().manual_seed(rows + k)
    n = 70
    if fmt == "q8_0":
        blocks = quantize_q8_0(torch.randn(n, k, generator=gen))
    else:
        blocks = make_q4_blocks(n, k, fmt == "q4_1", gen)
    qtype = QTYPE_IDS[fmt]
    weight = dequantize(blocks.reshape(-1), qtype, (n, k))
    x = torch.randn(rows, k, generator=gen) * 3
    x[0, :32] = 0  # an all-zero block (scale 0)
    got = kernels.qlinear(x, pack_ggml(qtype, blocks, int8_act=True))
    want = quantize_activations(x) @ weight.T
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # and it is an approximation of the exact product, not something else
    exact = x @ weight.T
    assert (got - exact).abs().max() < 0.05 * exact.abs().max()


def test_qlinear_rejects_bad_shapes(kernels):
    w = pack_ggml(QTYPE_IDS["q8_0"], quantize_q8_0(torch.randn(8, 64)))
    op = kernels.ops.qlinear
    with pytest.raises(RuntimeError, match="last dim"):
        op(torch.randn(2, 96), w.qs, w.d, w.m, w.qtype, 8, 64)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        op(torch.randn(2, 48), w.qs, w.d, w.m, w.qtype, 8, 48)
    with pytest.raises(RuntimeError, match="repacked ggml layout"):
        op(torch.randn(2, 64), w.qs, w.d, w.m, w.qtype, 4, 64)
    with pytest.raises(RuntimeError, match="unsupported ggml type"):
        op(torch.randn(2, 64), w.qs, w.d, w.m, 13, 8, 64)  # Q5_K
    with pytest.raises(RuntimeError, match="Q4_1 needs m"):
        op(torch.randn(2, 64), w.qs[:, :32].contiguous(), w.d, w.m, QTYPE_IDS["q4_1"], 8, 64)


def make_q4_k_blocks(n: int, k: int, gen) -> torch.Tensor:
    """Random ggml Q4_K super-blocks: [n, k/256 * 144] uint8, with sane fp16 d and dmin."""
    ns = k // 256
    d = (torch.rand(n, ns, 2, generator=gen) * 0.01 + 0.001).half()
    rest = torch.randint(0, 256, (n, ns, 140), generator=gen, dtype=torch.uint8)
    return torch.cat([d.view(torch.uint8).reshape(n, ns, 4), rest], -1).reshape(n, -1).contiguous()


def make_q6_k_blocks(n: int, k: int, gen) -> torch.Tensor:
    """Random ggml Q6_K super-blocks: [n, k/256 * 210] uint8 (ql | qh | int8 scales | d fp16),
    scales of both signs."""
    ns = k // 256
    body = torch.randint(0, 256, (n, ns, 208), generator=gen, dtype=torch.uint8)
    d = (torch.rand(n, ns, 1, generator=gen) * 0.01 + 0.001).half()
    return torch.cat([body, d.view(torch.uint8).reshape(n, ns, 2)], -1).reshape(n, -1).contiguous()


def make_blocks(fmt: str, n: int, k: int, gen) -> torch.Tensor:
    if fmt == "q8_0":
        return quantize_q8_0(torch.randn(n, k, generator=gen))
    if fmt == "q4_k":
        return make_q4_k_blocks(n, k, gen)
    if fmt == "q6_k":
        return make_q6_k_blocks(n, k, gen)
    return make_q4_blocks(n, k, fmt == "q4_1", gen)


@pytest.mark.parametrize("fmt", ["q4_k", "q6_k"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 16, 17])
@pytest.mark.parametrize("int8_act", [False, True])
def test_qlinear_k_quants_equal_dequantized_matmul(kernels, fmt, rows, int8_act):
    """Q4_K in its own super-block form, Q6_K widened to bytes: the kernel's weights are ggml's
    dequantization of the file's blocks (exact, so only summation order differs), at every
    tile shape; with 8-bit activations the reference quantizes x as the build does (per 256
    elements on the AVX2 super-block tiles; elsewhere Q6_K takes float32 activations)."""
    gen = torch.Generator().manual_seed(rows)
    n, k = 70, 512
    blocks = make_blocks(fmt, n, k, gen)
    weight = dequantize(blocks.reshape(-1), QTYPE_IDS[fmt], (n, k))
    x = torch.randn(rows, k, generator=gen)
    got = kernels.qlinear(x, pack_ggml(QTYPE_IDS[fmt], blocks, int8_act=int8_act))
    superblock = torch.ops.hearth.kquant_superblock_act()
    quantized = int8_act and (fmt == "q4_k" or superblock)
    want = (quantize_activations(x, 256 if superblock else 32) if quantized else x) @ weight.T
    # float32 summation order over 512 products of weights up to ~10
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("fmt", ["q4_k", "q6_k"])
@pytest.mark.parametrize("n, k", [(71, 768), (130, 512)])  # odd N, 3 super-blocks; 2+ tasks
def test_qlinear_int8_k_quants_at_every_row_count(kernels, fmt, n, k):
    """Prompt steps of 1..600 rows with 8-bit activations (the AVX2 builds' many-row Q4_K GEMM,
    csrc/kquant_gemm.h qlinear_q4k_gemm, from kQ4KGemmMinRows rows; the tiles below): each row
    equals the quantized reference, and the same row through a 1-row call (the decode tile)."""
    gen = torch.Generator().manual_seed(n + k)
    blocks = make_blocks(fmt, n, k, gen)
    weight = dequantize(blocks.reshape(-1), QTYPE_IDS[fmt], (n, k))
    w = pack_ggml(QTYPE_IDS[fmt], blocks, int8_act=True)
    # eighths up to 127 / 8, reached in every super-block: the 8-bit activations are exact, so
    # no rounding tie can fall differently in the reference (rounding is tested above)
    x = torch.randint(-127, 128, (600, k), generator=gen).float() / 8
    x[:, ::256] = 127 / 8
    x[3, :256] = 0  # an all-zero super-block (scale 0)
    superblock = torch.ops.hearth.kquant_superblock_act()
    quantized = fmt == "q4_k" or superblock
    want = (quantize_activations(x, 256 if superblock else 32) if quantized else x) @ weight.T
    tol = dict(rtol=1e-4, atol=1e-5 * want.abs().max().item())
    single = torch.cat([kernels.qlinear(x[i:i + 1], w) for i in range(8)])
    torch.testing.assert_close(single, want[:8], **tol)
    op = torch.ops.hearth.qlinear
    for rows in range(1, 601):
        threads = 2 if rows % 3 else 1
        got = op(x[:rows], w.qs, w.d, w.m, w.qtype, n, k, threads, True)
        torch.testing.assert_close(got, want[:rows], **tol, msg=lambda m: f"{rows} rows: {m}")
        torch.testing.assert_close(got[:8], single[:rows], **tol)


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0", "q4_k", "q6_k"])
def test_repack_ggml_equals_torch_pack(kernels, fmt):
    """The kernels' repack (QKV-style parts stacked, and expert-style groups) gives the torch
    reference's layout byte for byte."""
    from hearth.ops.cpu_kernels import pack_ggml_parts
    gen = torch.Generator().manual_seed(3)
    qtype, k = QTYPE_IDS[fmt], 512
    parts = [make_blocks(fmt, 2 * r, k, gen) for r in (6, 2)]
    got = pack_ggml_parts(qtype, parts, [6, 2], groups=2)
    stacked = torch.cat([p.view(2, r, -1) for p, r in zip(parts, (6, 2))], 1).reshape(16, -1)
    want = pack_ggml(qtype, stacked)
    for name in ("qs", "d", "m"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert (got.out_features, got.in_features) == (16, k)


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0", "q4_k", "q6_k"])
def test_dequant_rows_are_the_files_values(kernels, fmt):
    """dequant_rows gives gguf's dequantization bit for bit (float32), rounded once (bf16), for
    any rows in any order; a row out of range is an error naming it."""
    gen = torch.Generator().manual_seed(5)
    n, k = 37, 512
    blocks = make_blocks(fmt, n, k, gen)
    qtype = QTYPE_IDS[fmt]
    weight = dequantize(blocks.reshape(-1), qtype, (n, k))
    w = pack_ggml(qtype, blocks)
    rows = torch.tensor([36, 0, 5, 5, 17])
    assert torch.equal(kernels.dequant_rows(w, rows), weight[rows])
    assert torch.equal(kernels.dequant_rows(w, torch.arange(n)), weight)
    assert torch.equal(kernels.dequant_rows(w, rows, torch.bfloat16), weight[rows].bfloat16())
    assert kernels.dequant_rows(w, torch.zeros(0, dtype=torch.long)).shape == (0, k)
    with pytest.raises(RuntimeError, match="row 37 out of range"):
        kernels.dequant_rows(w, torch.tensor([37]))


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0", "q4_k", "q6_k"])
def test_requantize_q8_0_equals_quantizing_the_dequantized_rows(kernels, fmt):
    """The kernels' requantization of a packed weight is quantize_q8_0 of its exact values,
    byte for byte (a Q8_0 weight comes back as its own blocks)."""
    gen = torch.Generator().manual_seed(11)
    n, k = 130, 512
    blocks = make_blocks(fmt, n, k, gen)
    weight = dequantize(blocks.reshape(-1), QTYPE_IDS[fmt], (n, k))
    got = kernels.requantize_q8_0(pack_ggml(QTYPE_IDS[fmt], blocks))
    assert torch.equal(got, quantize_q8_0(weight))
    if fmt == "q8_0":
        assert torch.equal(got, blocks)


def test_q4_k_rejects_widths_not_whole_super_blocks(kernels):
    w = pack_ggml(QTYPE_IDS["q4_k"], make_q4_k_blocks(4, 256, torch.Generator().manual_seed(0)))
    with pytest.raises(RuntimeError, match="Q4_K / Q6_K need in_features % 256"):
        kernels.ops.qlinear(torch.randn(1, 224), w.qs[:, :112].contiguous(), w.d, w.m, w.qtype,
                            4, 224)
    with pytest.raises(RuntimeError, match="Q4_K needs m uint8"):
        kernels.ops.qlinear(torch.randn(1, 256), w.qs, w.d, w.d, w.qtype, 4, 256)


def test_q8_0_quantization_error_is_within_half_a_step():
    w = torch.randn(16, 64)
    blocks = quantize_q8_0(w)
    back = dequantize(blocks.reshape(-1), QTYPE_IDS["q8_0"], (16, 64))
    step = w.reshape(16, 2, 32).abs().amax(-1, keepdim=True) / 127
    assert ((back - w).reshape(16, 2, 32).abs() <= step * 0.5 + 1e-3 * step).all()


def test_norms_and_silu(kernels):
    gen = torch.Generator().manual_seed(1)
    x, r, w = (torch.randn(7, 40, generator=gen) for _ in range(3))
    w = w[0]
    ref = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(kernels.ops.rms_norm(x, w, 1e-6), ref)
    residual = r.clone()
    got = kernels.ops.add_rms_norm(x, residual, w, 1e-6)
    s = r + x
    torch.testing.assert_close(residual, s)
    torch.testing.assert_close(got, w * (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6)))
    gu = torch.randn(5, 2 * 24, generator=gen) * 4
    torch.testing.assert_close(kernels.ops.silu_mul(gu), F.silu(gu[:, :24]) * gu[:, 24:])


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_rope_write_kv_equals_rotary_then_write(kernels, cache_dtype):
    gen = torch.Generator().manual_seed(2)
    heads, kv_heads, dim, tokens = 4, 2, 16, 6
    rope = RotaryEmbedding(dim, 64, 10000.0, None)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen)
    positions = torch.tensor([0, 5, 9, 3, 40, 63])
    slots = torch.tensor([7, 0, 12, 3, 31, 20])
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], -1)
    ref_q, ref_k = rope(positions, q.reshape(tokens, heads, dim), k.reshape(tokens, kv_heads, dim))
    ref_kc = torch.zeros(4, 8, kv_heads, dim, dtype=cache_dtype)
    ref_vc = torch.zeros_like(ref_kc)
    write_kv(ref_k.to(cache_dtype), v.reshape(tokens, kv_heads, dim).to(cache_dtype), ref_kc,
             ref_vc, slots)
    kc, vc = torch.zeros_like(ref_kc), torch.zeros_like(ref_vc)
    kernels.ops.rope_write_kv(qkv, positions, rope.cos, rope.sin, kc, vc, slots, heads,
                              kv_heads, dim)
    torch.testing.assert_close(qkv[:, : heads * dim].reshape(tokens, heads, dim), ref_q)
    torch.testing.assert_close(kc, ref_kc)
    torch.testing.assert_close(vc, ref_vc)


@pytest.mark.parametrize("x_dtype, out_dtype", [(torch.bfloat16, torch.bfloat16),
                                                 (torch.float32, torch.bfloat16),
                                                 (torch.bfloat16, torch.float32)])
def test_norms_and_silu_in_bf16(kernels, x_dtype, out_dtype):
    """--prefill-dtype bfloat16's activations: fp32 math on widened inputs, outputs rounded to
    nearest even (exactly torch's .to(bfloat16)); the residual stays fp32."""
    gen = torch.Generator().manual_seed(3)
    x, r, w = (torch.randn(9, 72, generator=gen) for _ in range(3))
    x, w = x.to(x_dtype), w[0]
    xf = x.float()
    ref = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5))
    got = kernels.ops.rms_norm(x, w, 1e-5, out_dtype == torch.bfloat16)
    assert got.dtype == out_dtype
    torch.testing.assert_close(got.float(), ref.to(out_dtype).float(), rtol=0, atol=1e-5 if
                               out_dtype == torch.float32 else 0.02)
    residual = r.clone()
    got = kernels.ops.add_rms_norm(x, residual, w, 1e-5, out_dtype == torch.bfloat16)
    s = r + xf
    assert residual.dtype == torch.float32 and got.dtype == out_dtype
    torch.testing.assert_close(residual, s)
    ref = w * (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5))
    torch.testing.assert_close(got.float(), ref.to(out_dtype).float(), rtol=0.01, atol=1e-5)
    gu = (torch.randn(5, 2 * 40, generator=gen) * 4).to(x_dtype)
    got = kernels.ops.silu_mul(gu)
    ref = F.silu(gu[:, :40].float()) * gu[:, 40:].float()
    assert got.dtype == x_dtype
    torch.testing.assert_close(got.float(), ref.to(x_dtype).float(), rtol=0.01, atol=1e-5)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        kernels.ops.silu_mul(gu.half())


@pytest.mark.parametrize("kv_dtype", SCALED_KV)
@pytest.mark.parametrize("qkv_dtype", [torch.float32, torch.bfloat16])
def test_rope_write_kv_into_scaled_rows_as_kv_quant_writes_them(kernels, qkv_dtype, kv_dtype):
    """An int8 or fp8 cache gets, per token and KV head, exactly the bytes `kv_quant.quantize`
    makes of k and v as qkv holds them after RoPE (values, then the float32 scale): the fused
    write and the torch path store the same cache. Rows span 8 decades of magnitude (fp8's
    subnormal codes); an all-zero row stores scale 0."""
    gen = torch.Generator().manual_seed(8)
    heads, kv_heads, dim, tokens = 4, 2, 64, 7
    rope = RotaryEmbedding(dim, 64, 10000.0, None)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen) * 3
    qkv *= torch.logspace(-8, 0, qkv.shape[1]).roll(tokens)  # small values beside large ones
    qkv = qkv.to(qkv_dtype)
    qkv[2, (heads + kv_heads) * dim :] = 0  # token 2's V rows
    positions, slots = torch.tensor([0, 1, 2, 33, 60, 5, 6]), torch.tensor([3, 9, 0, 14, 7, 8, 1])
    kc = torch.zeros(2, 8, kv_heads, dim + 4, dtype=kv_dtype)
    vc = torch.zeros_like(kc)
    kernels.ops.rope_write_kv(qkv, positions, rope.cos, rope.sin, kc, vc, slots, heads,
                              kv_heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].reshape(tokens, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim :].reshape(tokens, kv_heads, dim)
    flat_k, flat_v = kc.view(-1, kv_heads, dim + 4), vc.view(-1, kv_heads, dim + 4)
    as_bytes = lambda t: t.view(torch.uint8)  # noqa: E731 (fp8 has no torch.equal)
    assert torch.equal(as_bytes(flat_k[slots]), as_bytes(kv_quant.quantize(k, kv_dtype)))
    assert torch.equal(as_bytes(flat_v[slots]), as_bytes(kv_quant.quantize(v, kv_dtype)))
    assert kv_quant.dequantize(flat_v[slots[2]]).abs().max() == 0
    with pytest.raises(RuntimeError, match="head_dim \\+ 4"):
        kernels.ops.rope_write_kv(qkv, positions, rope.cos, rope.sin, kc[..., :dim].contiguous(),
                                  vc[..., :dim].contiguous(), slots, heads, kv_heads, dim)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_rope_write_kv_in_bf16(kernels, cache_dtype):
    """bf16 qkv: rotated in fp32 and stored back rounded; the cache gets k and v exactly as qkv
    now holds them (widened for an fp32 cache), so a prompt attending to its own fresh keys and
    a later read of the cache see the same numbers."""
    gen = torch.Generator().manual_seed(4)
    heads, kv_heads, dim, tokens = 3, 1, 64, 5
    rope = RotaryEmbedding(dim, 64, 10000.0, None)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).bfloat16()
    positions, slots = torch.tensor([0, 1, 2, 33, 60]), torch.tensor([3, 9, 0, 14, 7])
    q, k, v = qkv.float().split([heads * dim, kv_heads * dim, kv_heads * dim], -1)
    ref_q, ref_k = rope(positions, q.reshape(tokens, heads, dim), k.reshape(tokens, kv_heads, dim))
    kc = torch.zeros(2, 8, kv_heads, dim, dtype=cache_dtype)
    vc = torch.zeros_like(kc)
    kernels.ops.rope_write_kv(qkv, positions, rope.cos, rope.sin, kc, vc, slots, heads,
                              kv_heads, dim)
    got_q = qkv[:, : heads * dim].reshape(tokens, heads, dim)
    got_k = qkv[:, heads * dim : (heads + kv_heads) * dim].reshape(tokens, kv_heads, dim)
    torch.testing.assert_close(got_q.float(), ref_q.bfloat16().float(), rtol=0, atol=0.02)
    torch.testing.assert_close(got_k.float(), ref_k.bfloat16().float(), rtol=0, atol=0.02)
    flat_k, flat_v = kc.view(-1, kv_heads, dim), vc.view(-1, kv_heads, dim)
    assert torch.equal(flat_k[slots].float(), got_k.float())
    assert torch.equal(flat_v[slots].float(), v.reshape(tokens, kv_heads, dim))


def random_cache(gen, shape, dtype) -> torch.Tensor:
    """Random K or V of `shape` ([num_blocks, block_size, kv_heads, dim]) as a cache of `dtype`
    holds it (int8: quantized rows with their scale, the last dimension dim + 4)."""
    return kv_quant.to_cache(torch.randn(*shape, generator=gen), dtype)


def assert_same_cache(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal caches (float32: to assert_close's tolerance); fp8 rows as bytes, since a row's
    scale bytes read as e4m3 values can be NaN."""
    if got.dtype == torch.float8_e4m3fn:
        got, want = got.view(torch.uint8), want.view(torch.uint8)
    torch.testing.assert_close(got, want)


def takes_bf16_prefill_dots(kernels, cache_dtype, dim) -> bool:
    """Whether prefill_attention takes bf16 dot products here: a bf16 cache, head dim 64 or 128,
    a CPU with AVX512-BF16 (the query and the probabilities rounded to bf16 as the cache is)."""
    return (cache_dtype == torch.bfloat16 and dim in (64, 128)
            and bool(kernels.ops.bf16_dot_products()))


def assert_attention_close(got, want, bf16_dots: bool, tol: float = 2e-5) -> None:
    """Float32 math to `tol`; bf16 dot products (~2^-9 of each rounded operand; a wrong index or
    lane order gives errors ~0.1-1) on the largest and on the mean error."""
    if bf16_dots:
        err = (got.float() - want.float()).abs()
        assert err.max() < 2e-2 and err.mean() < 1e-3, (err.max(), err.mean())
    else:
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def scattered_block_tables(context_lens, block_size, num_blocks, gen) -> list[list[int]]:
    """One block table per request, over a random permutation of the pool (never adjacent)."""
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for ctx in context_lens:
        n = -(-ctx // block_size)
        tables.append(perm[used : used + n])
        used += n
    return tables


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("split", [16, 512])  # many context splits, and one
# head_dim 16 takes the generic loops; 64 and 128 the AVX-512 ones (with 9 query heads per KV
# head: more than the 8 whose outputs stay in registers).
@pytest.mark.parametrize("heads, kv_heads, dim", [(6, 2, 16), (9, 3, 64), (18, 2, 128)])
def test_paged_attention_with_kernels_equals_torch_path(kernels, cache_dtype, split, heads,
                                                        kv_heads, dim):
    gen = torch.Generator().manual_seed(3)
    block_size, num_blocks = 4, 64
    kc = random_cache(gen, (num_blocks, block_size, kv_heads, dim), cache_dtype)
    vc = random_cache(gen, (num_blocks, block_size, kv_heads, dim), cache_dtype)
    # A mixed step: a prefill chunk over a cached prefix, then three decodes of different lengths.
    query_lens, context_lens = [5, 1, 1, 1], [13, 1, 30, 57]
    tables = scattered_block_tables(context_lens, block_size, num_blocks, gen)
    meta = build_attention_metadata(query_lens, context_lens, tables, block_size)
    tokens = sum(query_lens)
    q = torch.randn(tokens, heads, dim, generator=gen)
    k = torch.randn(tokens, kv_heads, dim, generator=gen)
    v = torch.randn(tokens, kv_heads, dim, generator=gen)
    ref = paged_attention(q, k, v, kc.clone(), vc.clone(), meta, 0.25)
    fast = CpuKernelAttentionBackend(type(kernels)(kernels.variant, decode_split=split))
    got = paged_attention(q, k, v, kc.clone(), vc.clone(), meta, 0.25, fast)
    torch.testing.assert_close(got, ref, rtol=2e-5, atol=2e-5)
    # Decodes only: the kernel's output is returned whole.
    dmeta = build_attention_metadata([1, 1], [30, 57], tables[2:], block_size)
    ref = paged_attention(q[:2], k[:2], v[:2], kc.clone(), vc.clone(), dmeta, 0.25)
    got = paged_attention(q[:2], k[:2], v[:2], kc.clone(), vc.clone(), dmeta, 0.25, fast)
    torch.testing.assert_close(got, ref, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("split", [16, 512])
@pytest.mark.parametrize("heads, kv_heads, dim", [(6, 2, 16), (9, 3, 64), (8, 2, 64)])
@pytest.mark.parametrize("window, sinks", [(None, True), (24, False), (24, True), (1, True)])
def test_decodes_under_sinks_and_a_window_take_the_kernel_and_equal_torchs(
        kernels, cache_dtype, split, heads, kv_heads, dim, window, sinks):
    """gpt-oss's attention (a learned sink per head, sliding layers) on a step of decodes: one
    decode_attention call (the splits start at the window's first key; the sinks join each
    head's softmax when the splits merge), equal to the torch backend's limited path; a verify
    step (queries of 3) takes the kernel under sinks alone and torch's path under a window."""
    from hearth.ops.attention import AttentionSpec
    from hearth.ops.attention_backends import TorchAttentionBackend

    gen = torch.Generator().manual_seed(5)
    block_size, num_blocks = 4, 96
    kc = random_cache(gen, (num_blocks, block_size, kv_heads, dim), cache_dtype)
    vc = random_cache(gen, (num_blocks, block_size, kv_heads, dim), cache_dtype)
    spec = AttentionSpec(window=window,
                         sinks=torch.randn(heads, generator=gen) * 2 if sinks else None)
    fast = CpuKernelAttentionBackend(type(kernels)(kernels.variant, decode_split=split))
    calls = []
    fast.limited = lambda *a, **kw: calls.append(1) or TorchAttentionBackend.limited(fast, *a, **kw)
    for query_lens, context_lens in (([1, 1, 1, 1], [1, 20, 57, 130]), ([3, 1], [40, 90])):
        tables = scattered_block_tables(context_lens, block_size, num_blocks, gen)
        meta = build_attention_metadata(query_lens, context_lens, tables, block_size)
        tokens = sum(query_lens)
        q = torch.randn(tokens, heads, dim, generator=gen)
        k = torch.randn(tokens, kv_heads, dim, generator=gen)
        v = torch.randn(tokens, kv_heads, dim, generator=gen)
        torch_backend = TorchAttentionBackend()
        k1, v1, k2, v2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
        torch_backend.write_kv(k, v, k1, v1, meta)
        fast.write_kv(k, v, k2, v2, meta)
        want = torch_backend.attend(q, k, v, k1, v1, meta, 0.25, spec)
        before = len(calls)
        got = fast.attend(q, k, v, k2, v2, meta, 0.25, spec)
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
        took_torch = len(calls) > before
        assert took_torch == (max(query_lens) > 1 and window is not None)
    with pytest.raises(RuntimeError, match="one sink per query head"):
        kernels.ops.decode_attention(q, k2, v2, meta.short_block_table_i32, meta.short_context_lens,
                                     0.25, 512, 1, meta.short_query_lens, torch.zeros(heads + 1), 0)
    with pytest.raises(RuntimeError, match="a window takes one query per request"):
        kernels.ops.decode_attention(q, k2, v2, meta.short_block_table_i32, meta.short_context_lens,
                                     0.25, 512, 1, meta.short_query_lens, None, 24)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_long_context_decodes_take_the_parallel_path(kernels, cache_dtype):
    gen = torch.Generator().manual_seed(4)
    heads, kv_heads, dim, block_size = 9, 3, 64, 16
    context_lens = [700, 1500, 33]  # over the serial threshold; uneven splits
    num_blocks = sum(-(-c // block_size) for c in context_lens)
    kc = random_cache(gen, (num_blocks, block_size, kv_heads, dim), cache_dtype)
    vc = random_cache(gen, (num_blocks, block_size, kv_heads, dim), cache_dtype)
    tables = scattered_block_tables(context_lens, block_size, num_blocks, gen)
    meta = build_attention_metadata([1, 1, 1], context_lens, tables, block_size)
    q = torch.randn(3, heads, dim, generator=gen)
    k = torch.randn(3, kv_heads, dim, generator=gen)
    v = torch.randn(3, kv_heads, dim, generator=gen)
    ref = paged_attention(q, k, v, kc.clone(), vc.clone(), meta, 0.125)
    fast = CpuKernelAttentionBackend(type(kernels)(kernels.variant, decode_split=256))
    got = paged_attention(q, k, v, kc.clone(), vc.clone(), meta, 0.125, fast)
    torch.testing.assert_close(got, ref, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("heads, kv_heads, dim", [(6, 2, 16), (9, 3, 64), (18, 2, 128)])
@pytest.mark.parametrize("seed", [0, 1])
def test_short_queries_attend_causally_in_the_kernel(kernels, cache_dtype, heads, kv_heads, dim,
                                                     seed):
    """Requests with 1..16 new tokens (speculative verify steps), causal among them, beside a
    long prefill chunk (SDPA path) and plain decodes; ragged, scattered block tables; contexts
    past the serial threshold and across many context splits."""
    gen = torch.Generator().manual_seed(10 + seed)
    block_size = 16
    query_lens = [int(x) for x in torch.randint(1, 17, (5,), generator=gen)] + [16, 1, 40]
    context_lens = [q + int(torch.randint(0, 900, (1,), generator=gen)) for q in query_lens]
    context_lens[1] = query_lens[1]  # nothing cached before the new tokens
    num_blocks = sum(-(-c // block_size) for c in context_lens) + 3
    kc = random_cache(gen, (num_blocks, block_size, kv_heads, dim), cache_dtype)
    vc = random_cache(gen, (num_blocks, block_size, kv_heads, dim), cache_dtype)
    tables = scattered_block_tables(context_lens, block_size, num_blocks, gen)
    tokens = sum(query_lens)
    q = torch.randn(tokens, heads, dim, generator=gen)
    # K/V already representable in the cache dtype: the torch path attends to a request's own
    # unrounded keys when nothing is cached before them, the kernel always reads the cache.
    k = kv_quant.as_cached(torch.randn(tokens, kv_heads, dim, generator=gen), cache_dtype)
    v = kv_quant.as_cached(torch.randn(tokens, kv_heads, dim, generator=gen), cache_dtype)
    fast = CpuKernelAttentionBackend(type(kernels)(kernels.variant, decode_split=128))
    # mixed with a 40-token prefill; short queries only; and with the kernel taking only
    # decodes (the others down the SDPA loop, kernels present)
    for lo, hi, short_max in ((0, 8, None), (0, 7, None), (0, 8, 1)):
        meta = build_attention_metadata(query_lens[lo:hi], context_lens[lo:hi], tables[lo:hi],
                                        block_size, short_max=short_max)
        rows = slice(0, meta.num_tokens)
        ref = paged_attention(q[rows], k[rows], v[rows], kc.clone(), vc.clone(), meta, 0.125)
        got = paged_attention(q[rows], k[rows], v[rows], kc.clone(), vc.clone(), meta, 0.125, fast)
        prompt = meta.num_short_tokens < meta.num_tokens  # the 40-token chunk: prefill_attention
        assert_attention_close(got, ref, prompt and takes_bf16_prefill_dots(kernels, cache_dtype, dim))


def masked_attention_reference(q, kc, vc, table, context_len, scale):
    """Query i of a chunk of q_len sees tokens [0, context_len - q_len + i]: float64 softmax with
    the mask written out, K/V gathered from the cache through the block table."""
    kv_heads, dim = kc.shape[2], q.shape[2]
    k = kv_quant.widen(kc[table.long()], torch.float64).reshape(-1, kv_heads, dim)[:context_len]
    v = kv_quant.widen(vc[table.long()], torch.float64).reshape(-1, kv_heads, dim)[:context_len]
    q_len, group = q.shape[0], q.shape[1] // kv_heads
    positions = torch.arange(q_len)[:, None] + context_len - q_len
    visible = torch.arange(context_len)[None, :] <= positions
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    p = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", p, v).float()


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
# head_dim 16 takes the plain loops; 64 and 128 the AVX-512 or AVX2 tiles, with 1, 3, 4 and 5 query
# heads per KV head (5: a query tile of 9 positions, not a power of two).
@pytest.mark.parametrize("heads, kv_heads, dim", [(6, 2, 16), (4, 4, 64), (9, 3, 64), (8, 2, 128),
                                                  (10, 2, 64)])
# (cached prefix, chunk, block size): fresh prompts of 1 token, under and over one key tile;
# chunks whose query tiles straddle key tiles; a prefix longer than the chunk; tiny blocks.
@ALL_THREADS
@pytest.mark.parametrize("prefix, q_len, block_size", [(0, 1, 16), (0, 5, 16), (0, 64, 16),
                                                       (0, 150, 16), (40, 77, 16), (63, 65, 16),
                                                       (300, 20, 4), (17, 3, 8)])
def test_prefill_attention_equals_masked_softmax(kernels, cache_dtype, heads, kv_heads, dim,
                                                 prefix, q_len, block_size):
    gen = torch.Generator().manual_seed(prefix + q_len)
    context_len = prefix + q_len
    num_blocks = -(-context_len // block_size) + 4
    kc = random_cache(gen, (num_blocks, block_size, kv_heads, dim), cache_dtype)
    vc = random_cache(gen, (num_blocks, block_size, kv_heads, dim), cache_dtype)
    used = -(-context_len // block_size)
    table = torch.randperm(num_blocks, generator=gen)[:used].to(torch.int32)
    q = torch.randn(q_len, heads, dim, generator=gen)
    ref = masked_attention_reference(q, kc, vc, table, context_len, dim ** -0.5)
    for threads in (1, 2):
        got = kernels.ops.prefill_attention(q, kc, vc, table, context_len, dim ** -0.5, threads)
        assert_attention_close(got, ref, takes_bf16_prefill_dots(kernels, cache_dtype, dim), 1e-5)


def assert_rejects_bad_chunks(op, q, kc):
    """A prefill-attention op over a 4-block cache of 16-token blocks, 5 queries in q."""
    table = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="outside"):
        op(q, kc, kc, table, 4, 1.0, 1)  # 5 queries in a 4-token context
    with pytest.raises(RuntimeError, match="longer than its block table"):
        op(q, kc, kc, table, 33, 1.0, 1)
    with pytest.raises(RuntimeError, match="out of range"):
        op(q, kc, kc, torch.tensor([0, 4], dtype=torch.int32), 20, 1.0, 1)
    with pytest.raises(RuntimeError, match="alike"):
        op(q, kc, kc.bfloat16(), table, 20, 1.0, 1)


def test_prefill_attention_rejects_bad_input(kernels):
    assert_rejects_bad_chunks(kernels.ops.prefill_attention, torch.zeros(5, 2, 16),
                              torch.zeros(4, 16, 1, 16))


def needs_amx(kernels):
    if not kernels.amx_prefill_attention(64):
        pytest.skip(f"the {kernels.variant} build has no AMX attention (avx512amx does)")


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (9, 3), (10, 2)])
# fresh prompts of 1, 17 (one query block + 1) and 100 tokens; chunks after a prefix that ends
# inside a 32-key block and one longer than the chunk; tiny blocks; a context packed in several
# tasks per kv head (more than 16 groups of 32 keys)
@ALL_THREADS
@pytest.mark.parametrize("prefix, q_len, block_size", [(0, 1, 16), (0, 17, 16), (0, 100, 16),
                                                       (40, 77, 16), (63, 33, 16), (300, 20, 4),
                                                       (17, 3, 8), (1000, 45, 16)])
def test_amx_prefill_attention_equals_masked_softmax(kernels, cache_dtype, heads, kv_heads,
                                                     prefix, q_len, block_size):
    """bf16 queries and bf16 probabilities on the tiles, fp32 softmax statistics: within bf16
    rounding of a float64 softmax over the same (cache-rounded) K/V."""
    needs_amx(kernels)
    gen = torch.Generator().manual_seed(prefix + q_len)
    context_len = prefix + q_len
    num_blocks = -(-context_len // block_size) + 4
    kc = random_cache(gen, (num_blocks, block_size, kv_heads, 64), cache_dtype)
    vc = random_cache(gen, (num_blocks, block_size, kv_heads, 64), cache_dtype)
    table = torch.randperm(num_blocks, generator=gen)[:-(-context_len // block_size)].int()
    q = torch.randn(q_len, heads, 64, generator=gen).bfloat16()
    # references over the operands as the kernel rounds them: q and K/V in bf16
    ref = masked_attention_reference(q.float(), kc.bfloat16().float(), vc.bfloat16().float(),
                                     table, context_len, 0.125)
    for threads in (1, 2):
        got = kernels.ops.amx_prefill_attention(q, kc, vc, table, context_len, 0.125, threads)
        assert got.dtype == torch.bfloat16 and got.shape == q.shape
        torch.testing.assert_close(got.float(), ref, rtol=0.02, atol=0.02)
    # a strided view of q (as the qkv projection hands it over) reads the same rows
    wide = torch.randn(q_len, heads + 2, 64, generator=gen).bfloat16()
    wide[:, :heads] = q
    got = kernels.ops.amx_prefill_attention(wide[:, :heads], kc, vc, table, context_len, 0.125, 2)
    torch.testing.assert_close(got.float(), ref, rtol=0.02, atol=0.02)


def test_amx_prefill_attention_rejects_bad_input(kernels):
    needs_amx(kernels)
    kc = torch.zeros(4, 16, 1, 64)
    q = torch.zeros(5, 2, 64, dtype=torch.bfloat16)
    table = torch.tensor([0, 1], dtype=torch.int32)
    op = kernels.ops.amx_prefill_attention
    with pytest.raises(RuntimeError, match="q bfloat16"):
        op(q.float(), kc, kc, table, 20, 1.0, 1)
    with pytest.raises(RuntimeError, match="q bfloat16"):
        op(torch.zeros(5, 2, 32, dtype=torch.bfloat16), kc, kc, table, 20, 1.0, 1)
    with pytest.raises(RuntimeError, match="head dim 64"):
        op(q, torch.zeros(4, 16, 1, 32), torch.zeros(4, 16, 1, 32), table, 20, 1.0, 1)
    assert_rejects_bad_chunks(op, q, kc)


def test_amx_prefill_attention_through_paged_attention(kernels):
    """bf16 prompt chunks (a --prefill-dtype bfloat16 step) take the AMX kernel in
    paged_attention and agree with the torch path (flash kernel in bf16) to bf16 rounding."""
    needs_amx(kernels)
    gen = torch.Generator().manual_seed(5)
    block_size, heads, kv_heads = 16, 9, 3
    query_lens, context_lens = [70, 1, 45], [70, 30, 45 + 50]
    num_blocks = sum(-(-c // block_size) for c in context_lens) + 2
    kc = torch.randn(num_blocks, block_size, kv_heads, 64, generator=gen)
    vc = torch.randn(num_blocks, block_size, kv_heads, 64, generator=gen)
    tables = scattered_block_tables(context_lens, block_size, num_blocks, gen)
    tokens = sum(query_lens)
    q = torch.randn(tokens, heads, 64, generator=gen).bfloat16()
    k = torch.randn(tokens, kv_heads, 64, generator=gen).bfloat16()
    v = torch.randn(tokens, kv_heads, 64, generator=gen).bfloat16()
    meta = build_attention_metadata(query_lens, context_lens, tables, block_size)
    ref = paged_attention(q, k, v, kc.clone(), vc.clone(), meta, 0.125)
    got = paged_attention(q, k, v, kc.clone(), vc.clone(), meta, 0.125,
                          CpuKernelAttentionBackend(kernels))
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), ref.float(), rtol=0.02, atol=0.02)


@pytest.mark.parametrize("dim", [16, 64])  # the generic loops, the AVX-512 ones
def test_every_fp8_code_widens_exactly_in_both_attention_kernels(kernels, dim):
    """A one-token context: attention returns that token's V row, so each of the 254 finite
    e4m3 codes (subnormals, both zeros, +-448), times its row's scale, must come back exactly
    as torch widens it -- through decode_attention and prefill_attention alike."""
    codes = torch.arange(256, dtype=torch.int32)
    codes = codes[(codes & 0x7F) != 0x7F].to(torch.uint8)  # 0x7F / 0xFF are e4m3's NaNs
    rows = torch.cat([codes, torch.zeros(2, dtype=torch.uint8)]).reshape(-1, dim)  # a request each
    n = rows.shape[0]
    scales = torch.tensor([1.0, 0.37, 3e-3, 1e4] * n)[:n]
    vc = torch.cat([rows, scales[:, None].view(torch.uint8)], -1).view(torch.float8_e4m3fn)
    vc = vc.reshape(n, 1, 1, dim + 4)  # [blocks, block_size 1, one KV head, dim + 4]
    want = kv_quant.dequantize(vc[:, 0])  # [n, 1, dim]
    kc = torch.zeros_like(vc)
    q = torch.randn(n, 1, dim)
    one = torch.ones(n, dtype=torch.int32)
    tables = torch.arange(n, dtype=torch.int32)[:, None]
    got = kernels.ops.decode_attention(q, kc, vc, tables, one, 1.0, 512, 1, one)
    assert torch.equal(got, want)
    for i in range(n):
        got = kernels.ops.prefill_attention(q[i : i + 1], kc, vc, tables[i], 1, 1.0, 1)
        assert torch.equal(got, want[i : i + 1])


@pytest.mark.parametrize("kv_dtype", SCALED_KV)
def test_attention_kernels_refuse_scaled_rows_without_their_scale(kernels, kv_dtype):
    q = torch.zeros(1, 2, 64)
    narrow = torch.zeros(2, 16, 1, 64, dtype=kv_dtype)  # head_dim wide: no room for a scale
    one = torch.ones(1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="head shapes"):
        kernels.ops.decode_attention(q, narrow, narrow, torch.zeros(1, 1, dtype=torch.int32), one,
                                     1.0, 512, 1, one)
    with pytest.raises(RuntimeError, match="head shapes"):
        kernels.ops.prefill_attention(q, narrow, narrow, torch.zeros(1, dtype=torch.int32), 1,
                                      1.0, 1)


def test_short_query_kernel_rejects_bad_metadata(kernels):
    kc = torch.zeros(4, 16, 1, 16)
    q = torch.zeros(5, 2, 16)
    table = torch.zeros(2, 2, dtype=torch.int32)
    op = kernels.ops.decode_attention
    with pytest.raises(RuntimeError, match="query lengths sum"):
        op(q, kc, kc, table, torch.tensor([8, 9], dtype=torch.int32), 1.0, 512, 1,
           torch.tensor([2, 2], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="outside"):
        op(q, kc, kc, table, torch.tensor([2, 9], dtype=torch.int32), 1.0, 512, 1,
           torch.tensor([3, 2], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="longer than its block table"):
        op(q, kc, kc, table, torch.tensor([8, 33], dtype=torch.int32), 1.0, 512, 1,
           torch.tensor([3, 2], dtype=torch.int32))


@pytest.mark.parametrize("cache_dtype", [torch.float32, *SCALED_KV])
def test_fused_layer_takes_short_query_steps(kernels, cache_dtype):
    """A step of short queries (1 + k tokens per request, as a speculative verify step) through
    the fused decoder layers (all layers in one `decode_layers` call, and one such call per
    layer) equals the same step through the module path (the same kernels op by op,
    with the per-request queries in the attention kernel)."""
    from hearth.models.arch import ModelArch
    from hearth.models.families.llama.model import LlamaForCausalLM

    torch.manual_seed(5)
    arch = ModelArch("llama", vocab_size=96, hidden_size=128, intermediate_size=256, num_layers=3,
                     num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=256)
    model = LlamaForCausalLM(arch)
    for p in model.parameters():
        p.data.normal_(0, 0.1)
    for norm in (m for m in model.modules() if type(m).__name__ == "RMSNorm"):
        norm.weight.data.normal_(1.0, 0.1)  # distinct per layer: a mixed-up layer shows
    model.use_kernels(kernels)
    for layer in model.layers:
        for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                    layer.mlp.down_proj):
            lin.set_quantized(pack_ggml(QTYPE_IDS["q8_0"], quantize_q8_0(lin.weight.data)), kernels)
    assert model.enable_fused_decode()
    calls = []
    model._fused_all = model._fused_all._replace(kernels=counting(kernels, calls, "all"))
    for layer in model.layers:
        layer._fused = layer._fused._replace(kernels=counting(kernels, calls, "layer"))
    block_size, num_blocks = 16, 24
    context_lens, query_lens = [40, 7, 100], [5, 7, 3]  # one request with nothing cached before
    gen = torch.Generator().manual_seed(6)
    tables = scattered_block_tables(context_lens, block_size, num_blocks, gen)
    kv = random_cache(gen, (arch.num_layers, 2, num_blocks, block_size, 2, 32), cache_dtype)
    meta = build_attention_metadata(query_lens, context_lens, tables, block_size)
    ids = torch.randint(0, 96, (sum(query_lens),), generator=gen)
    positions = torch.cat([torch.arange(c - q, c) for q, c in zip(query_lens, context_lens)])
    with torch.inference_mode():
        all_kv = kv.clone()
        fused_all, _ = model(ids, positions, meta, all_kv)
        assert calls == ["all"]  # one call for the whole step
        model._fused_all = None
        layer_kv = kv.clone()
        fused, _ = model(ids, positions, meta, layer_kv)
        assert calls == ["all"] + ["layer"] * arch.num_layers
        for layer in model.layers:
            layer._fused = None
        module_kv = kv.clone()
        ref, _ = model(ids, positions, meta, module_kv)
    torch.testing.assert_close(fused_all, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused, ref, rtol=1e-5, atol=1e-5)
    assert_same_cache(all_kv, module_kv)
    assert_same_cache(layer_kv, module_kv)


def counting(kernels, calls: list, name: str):
    """`kernels` with each fused decode call recorded in `calls` as `name`."""
    from types import SimpleNamespace

    def record(op):
        return lambda *a: calls.append(name) or op(*a)

    return SimpleNamespace(decode_layers=record(kernels.decode_layers),
                           mla_decode_layers=record(kernels.mla_decode_layers))


def quantize_for_kernels(model, kernels) -> None:
    """Q8_0 copies of every linear (and MoE expert stack) of `model`, as quantize_model
    attaches them."""
    from hearth.models.moe import FusedMoE

    for m in model.modules():
        if hasattr(m, "set_quantized") and m.weight.shape[1] % 32 == 0:
            m.set_quantized(pack_ggml(QTYPE_IDS["q8_0"], quantize_q8_0(m.weight.data)), kernels)
        elif isinstance(m, FusedMoE):
            m.set_quantized_experts(*(pack_ggml(QTYPE_IDS["q8_0"],
                                                quantize_q8_0(w.data.reshape(-1, w.shape[2])))
                                      for w in (m.w13, m.w2)), kernels)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", ["v3", "v2-no-q-lora"])
def test_fused_mla_layers_equal_the_module_path(kernels, cache_dtype, variant):
    """DeepSeek-V3 / V2 layers (MLA + dense or DeepSeek MoE MLP) on a step of short queries
    (decodes and 1 + k verify rows): the one `mla_decode_layers` call equals the modules (the
    same kernels and torch ops one by one): hidden states, residual, the latent rows written,
    the router's expert counts. V3: sigmoid + noaux_tc router with a correction bias, a q
    bottleneck, shared experts, rows of 40 (the attention's generic loop); V2: softmax +
    group_limited_greedy, q_proj, no shared experts, rows of 64 (its AVX-512 path)."""
    from hearth.models.arch import MlaSpec, ModelArch, MoeSpec
    from hearth.models.families.deepseek.model import DeepseekV3ForCausalLM
    from hearth.models.families.deepseek.quant_hooks import quantize_absorb

    v3 = variant == "v3"
    nope = 32 if v3 else 16  # V3: the absorbed up-projections packed (Q8_0); V2: kv_b float
    mla = MlaSpec(kv_lora_rank=32 if v3 else 56, qk_nope_head_dim=nope, qk_rope_head_dim=8,
                  v_head_dim=16, q_lora_rank=32 if v3 else None)
    moe = MoeSpec(num_experts=8, num_experts_per_tok=2, expert_intermediate_size=32,
                  dense_layers=(0,), scoring_func="sigmoid" if v3 else "softmax",
                  topk_method="noaux_tc" if v3 else "group_limited_greedy", n_group=4,
                  topk_group=2, routed_scaling_factor=2.5, num_shared_experts=1 if v3 else 0,
                  norm_topk_prob=v3)
    arch = ModelArch("deepseek_v3" if v3 else "deepseek_v2", vocab_size=96, hidden_size=64,
                     intermediate_size=96, num_layers=3, num_heads=4, num_kv_heads=4,
                     head_dim=nope + 8, max_position_embeddings=256, moe=moe, mla=mla)
    torch.manual_seed(11)
    model = DeepseekV3ForCausalLM(arch)
    for p in model.parameters():
        p.data.normal_(0, 0.1)
    for norm in (m for m in model.modules() if type(m).__name__ == "RMSNorm"):
        norm.weight.data.normal_(1.0, 0.1)
    for layer in model.layers[1:]:
        layer.mlp.gate.data.normal_(0, 1.0)  # well-separated routing scores
    model.use_kernels(kernels)
    quantize_for_kernels(model, kernels)
    assert quantize_absorb(model, kernels) == ({"absorbed-q8_0": 3} if v3 else {"none": 3})
    assert model.enable_fused_decode()
    calls = []
    model._fused_all = model._fused_all._replace(kernels=counting(kernels, calls, "mla"))
    block_size, num_blocks = 16, 24
    context_lens, query_lens = [40, 7, 100], [5, 7, 1]
    gen = torch.Generator().manual_seed(12)
    tables = scattered_block_tables(context_lens, block_size, num_blocks, gen)
    kv = random_cache(gen, (arch.num_layers, 1, num_blocks, block_size, 1, mla.latent_dim),
                      cache_dtype)
    meta = build_attention_metadata(query_lens, context_lens, tables, block_size)
    ids = torch.randint(0, 96, (sum(query_lens),), generator=gen)
    positions = torch.cat([torch.arange(c - q, c) for q, c in zip(query_lens, context_lens)])
    blocks = [layer.mlp for layer in model.layers[1:]]
    results = []
    for fused in (model._fused_all, None):
        model._fused_all = fused
        for b in blocks:
            b.expert_counts = torch.zeros(8, dtype=torch.int64)
        step_kv = kv.clone()
        with torch.inference_mode():
            hidden, _ = model(ids, positions, meta, step_kv)
        results.append((hidden, step_kv, [b.expert_counts.clone() for b in blocks]))
    assert calls == ["mla"]  # the fused run was one call; the module run none
    (got, got_kv, got_counts), (want, want_kv, want_counts) = results
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert_same_cache(got_kv, want_kv)
    assert [c.tolist() for c in got_counts] == [c.tolist() for c in want_counts]
    assert sum(c.sum().item() for c in got_counts) == 2 * 2 * sum(query_lens)


def test_fused_mla_layers_reject_what_they_do_not_cover(kernels):
    """Lists of the wrong length, a cache of another width or dtype: a clear error, no write."""
    x = torch.randn(1, 64)
    pos, slots = torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long)
    table, ctx = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    cos = torch.ones(16, 4)
    dims = [4, 16, 8, 16, 32, 32, 2, 4, 2, 1, 2, 1, 0, 96, 32]
    kvb = torch.zeros(4 * 32, 32)
    w = [torch.empty(0)] * 36
    w[10] = kvb

    def call(caches, weights=w, types=[0] * 9, d=dims):
        return kernels.ops.mla_decode_layers(
            x=x, residual=x, has_residual=False, weights=weights, qtypes=types, dims=d,
            fdims=[1e-6, 0.1, 1.0], expert_counts=[torch.empty(0)], rope_cos=cos, rope_sin=cos,
            caches=caches, positions=pos, slot_mapping=slots, block_tables=table,
            context_lens=ctx, query_lens=None, split=512, threads=1, int8_act=False)

    good = torch.zeros(2, 16, 1, 40)
    with pytest.raises(RuntimeError, match="per layer 36 tensors"):
        call([good], weights=w[:35])
    with pytest.raises(RuntimeError, match="per layer 36 tensors, 9 types"):
        call([good], types=[0] * 7)
    with pytest.raises(RuntimeError, match="15 dims"):
        call([good], d=dims[:14])
    with pytest.raises(RuntimeError, match="cache 0 must be float32 or bfloat16"):
        call([torch.zeros(2, 16, 1, 48)])
    with pytest.raises(RuntimeError, match="cache 0 must be float32 or bfloat16"):
        call([torch.zeros(2, 16, 1, 40, dtype=torch.int8)])
    with pytest.raises(RuntimeError, match="kv_b_proj float32"):
        call([good], weights=w[:10] + [kvb[:64]] + w[11:])
    # packed W_UK rows where these heads have none (nope 16: no whole 32-element blocks)
    bad_uk = [torch.zeros(4 * 16, 16, dtype=torch.uint8), torch.zeros(4 * 16, 1, dtype=torch.half),
              torch.empty(0, dtype=torch.half)]
    with pytest.raises(RuntimeError, match="mla_decode_layers: W_UK: in_features must be"):
        call([good], weights=w[:30] + bad_uk + w[33:], types=[0] * 7 + [8, 8])
    assert not good.any()


@pytest.mark.parametrize("int8_act", [False, True])
def test_mla_absorb_is_each_heads_qlinear(kernels, int8_act):
    """`mla_absorb`: x [T, H, K] (a strided view, as q_nope inside q is) through each head's
    rows of one packed [H N, K] weight equals qlinear on that head's rows alone, row for row
    (float32 activations: exactly the dequantized weight's products; 8-bit: the same numbers
    as qlinear's int8 path), and float reference within Q8_0 error."""
    gen = torch.Generator().manual_seed(5)
    T, H, N, K = 3, 5, 40, 64
    q = torch.randn(T, H, K + 8, generator=gen)
    x = q[..., :K]  # unit last stride, not contiguous
    w = torch.randn(H * N, K, generator=gen) * 0.1
    pw = pack_ggml(QTYPE_IDS["q8_0"], quantize_q8_0(w), int8_act=int8_act)
    got = kernels.ops.mla_absorb(x, pw.qs, pw.d, pw.m, pw.qtype, N, 2, int8_act)
    assert got.shape == (T, H, N)
    for h in range(H):
        head = pack_ggml(QTYPE_IDS["q8_0"], quantize_q8_0(w[h * N:(h + 1) * N]),
                         int8_act=int8_act)
        torch.testing.assert_close(got[:, h], kernels.qlinear(x[:, h].contiguous(), head),
                                   rtol=1e-5, atol=1e-5)
    ref = torch.einsum("thk,hnk->thn", x, w.view(H, N, K))
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()
    empty = kernels.ops.mla_absorb(x[:0], pw.qs, pw.d, pw.m, pw.qtype, N, 2, int8_act)
    assert empty.shape == (0, H, N)
    with pytest.raises(RuntimeError, match="mla_absorb: qs does not match"):
        kernels.ops.mla_absorb(x, pw.qs, pw.d, pw.m, pw.qtype, N + 1, 2, int8_act)
    with pytest.raises(RuntimeError, match="mla_absorb: x must be float32"):
        kernels.ops.mla_absorb(x.double(), pw.qs, pw.d, pw.m, pw.qtype, N, 2, int8_act)


def test_decode_layers_rejects_mismatched_lists(kernels):
    x = torch.randn(1, 32)
    kc = torch.zeros(2, 16, 1, 32)
    step = dict(positions=torch.zeros(1, dtype=torch.long),
                slot_mapping=torch.zeros(1, dtype=torch.long),
                block_tables=torch.zeros(1, 1, dtype=torch.int32),
                context_lens=torch.ones(1, dtype=torch.int32), query_lens=None)
    with pytest.raises(RuntimeError, match="per layer 14 weight tensors, 4 types"):
        kernels.ops.decode_layers(x=x, residual=x, has_residual=False, weights=[torch.ones(32)],
                                  qtypes=[], dims=[1, 1, 32, 64], fdims=[1.0, 1e-5], rope_cos=x,
                                  rope_sin=x, k_caches=[kc], v_caches=[kc], **step, split=512,
                                  threads=1, int8_act=False)
    with pytest.raises(RuntimeError, match="4 dims and 2 float dims"):
        kernels.ops.decode_layers(x=x, residual=x, has_residual=False,
                                  weights=[torch.empty(0)] * 14, qtypes=[0] * 4,
                                  dims=[1, 1, 32], fdims=[1.0, 1e-5], rope_cos=x,
                                  rope_sin=x, k_caches=[kc], v_caches=[kc], **step, split=512,
                                  threads=1, int8_act=False)


def test_fused_decode_layouts_are_the_dataclasses_fields(kernels):
    """The C++ structs the fused ops unpack (csrc/fused_args.h) name the same fields in the same
    order as the dataclasses the models fill (hearth/ops/fused_decode.py)."""
    from dataclasses import fields

    from hearth.ops import fused_decode as fd

    for name, cls in (("llama_layer", fd.LlamaLayerWeights), ("llama_shape", fd.LlamaShape),
                      ("mla_layer", fd.MlaLayerWeights), ("mla_shape", fd.MlaShape)):
        assert kernels.ops.fused_decode_layout(name) == [f.name for f in fields(cls)], name


def decode_layer_by_ops(ops, x, residual, has_residual, w: LlamaLayerWeights,
                        shape: LlamaShape, cos, sin, kc, vc, meta, positions, threads, int8_act):
    """The decoder layer as its separate kernels compute it, one op after another."""
    T, hidden = x.shape
    H, KVH, D, inter = shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.intermediate
    eps = shape.eps

    def linear(a, p, n):
        return ops.qlinear(a, p.qs, p.d, p.m, p.qtype, n, a.shape[1], threads, int8_act)

    residual = residual if has_residual else x
    normed = (ops.add_rms_norm(x, residual, w.in_norm, eps) if has_residual
              else ops.rms_norm(x, w.in_norm, eps))
    qkv = linear(normed, w.qkv, (H + 2 * KVH) * D)
    ops.rope_write_kv(qkv, positions, cos, sin, kc, vc, meta.slot_mapping, H, KVH, D)
    q = qkv[:, : H * D].reshape(T, H, D)
    attn = ops.decode_attention(q, kc, vc, meta.short_block_table_i32, meta.short_context_lens,
                                shape.scale, 512, threads, meta.short_query_lens)
    h = linear(attn.reshape(T, H * D), w.o, hidden)
    normed2 = ops.add_rms_norm(h, residual, w.post_norm, eps)
    out = linear(ops.silu_mul(linear(normed2, w.gate_up, 2 * inter)), w.down, hidden)
    return out, residual


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("int8_act", [False, True])
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("has_residual", [False, True])
@pytest.mark.parametrize("query_lens,context_lens", [([1], [7]), ([1, 1, 1], [3, 40, 700]),
                                                     ([3, 1, 5], [9, 1200, 20])])
def test_decode_layer_equals_its_ops_in_sequence(kernels, threads, int8_act, cache_dtype,
                                                 has_residual, query_lens, context_lens, request):
    """One fused decoder layer (`decode_layers` over one layer) computes what its kernels give,
    run one after another: same output, same residual, same K/V written to the cache. (It
    guards a rewrite of the layer's threading, such as one parallel region for all its
    phases.)"""
    if threads > 1:
        request.getfixturevalue("all_threads")  # the threaded path needs torch's threads
    gen = torch.Generator().manual_seed(sum(context_lens) + 7 * len(query_lens))
    H, KVH, D, hidden, inter, block_size, num_blocks = 9, 3, 64, 192, 320, 16, 160
    T = sum(query_lens)
    packed = []
    for n, k, fmt in (((H + 2 * KVH) * D, hidden, "q4_1"), (hidden, H * D, "q4_0"),
                      (2 * inter, hidden, "q4_1"), (hidden, inter, "q8_0")):
        blocks = (quantize_q8_0(torch.randn(n, k, generator=gen)) if fmt == "q8_0"
                  else make_q4_blocks(n, k, fmt == "q4_1", gen))
        packed.append(pack_ggml(QTYPE_IDS[fmt], blocks))
    rotary = RotaryEmbedding(D, 4096, 10000.0, None)
    kc = random_cache(gen, (num_blocks, block_size, KVH, D), cache_dtype)
    vc = random_cache(gen, (num_blocks, block_size, KVH, D), cache_dtype)
    tables = scattered_block_tables(context_lens, block_size, num_blocks, gen)
    meta = build_attention_metadata(query_lens, context_lens, tables, block_size)
    positions = torch.tensor([p for q, c in zip(query_lens, context_lens) for p in range(c - q, c)])
    x = torch.randn(T, hidden, generator=gen)
    residual = torch.randn(T, hidden, generator=gen)
    layer = LlamaLayerWeights(in_norm=torch.rand(hidden, generator=gen) + 0.5,
                              post_norm=torch.rand(hidden, generator=gen) + 0.5,
                              qkv=packed[0], o=packed[1], gate_up=packed[2], down=packed[3])
    shape = LlamaShape(num_heads=H, num_kv_heads=KVH, head_dim=D, intermediate=inter,
                       scale=0.125, eps=1e-5)
    stack = LlamaStack.pack([layer], shape, rotary.cos, rotary.sin, int8_act)

    ref_kc, ref_vc, ref_x, ref_res = kc.clone(), vc.clone(), x.clone(), residual.clone()
    want_out, want_res = decode_layer_by_ops(kernels.ops, ref_x, ref_res, has_residual, layer,
                                             shape, rotary.cos, rotary.sin, ref_kc, ref_vc, meta,
                                             positions, threads, int8_act)
    got_out, got_res = kernels.ops.decode_layers(
        x=x, residual=residual, has_residual=has_residual, weights=stack.weights,
        qtypes=stack.qtypes, dims=stack.dims, fdims=stack.fdims, rope_cos=stack.rope_cos,
        rope_sin=stack.rope_sin, k_caches=[kc], v_caches=[vc], positions=positions,
        slot_mapping=meta.slot_mapping, block_tables=meta.short_block_table_i32,
        context_lens=meta.short_context_lens, query_lens=meta.short_query_lens, split=512,
        threads=threads, int8_act=int8_act)
    torch.testing.assert_close(got_out, want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_res, want_res, rtol=1e-6, atol=1e-6)
    assert_same_cache(kc.view(torch.uint8), ref_kc.view(torch.uint8))  # the same bytes
    assert_same_cache(vc.view(torch.uint8), ref_vc.view(torch.uint8))


@pytest.mark.parametrize("width,cache_dtype", [(320, torch.float32), (576, torch.bfloat16),
                                               (320, torch.bfloat16), (48, torch.float32)])
def test_short_queries_over_one_wide_latent_head_equal_torch(kernels, width, cache_dtype):
    """MLA's absorbed decode: every query head attends to one shared row per token (KV head
    count 1, rows of 320 / 576 values: the AVX-512 wide path; 48: the generic one), value = the
    same row; decodes and multi-token verify steps, contexts across splits, bf16 cache. Where
    the build takes AVX512-BF16 dot products for a bf16 cache (`bf16_dot_products`), the query
    and the probabilities are rounded to bf16 as the cache is: float32 math is held to 1e-4,
    that path to bf16's rounding (~2^-9 of a value), on the largest and on the mean error."""
    gen = torch.Generator().manual_seed(7)
    block_size, heads = 16, 16
    query_lens, context_lens = [1, 3, 1, 16], [1, 37, 700, 300]
    num_blocks = sum(-(-c // block_size) for c in context_lens) + 3
    cache = random_cache(gen, (num_blocks, block_size, 1, width), cache_dtype)
    tables = scattered_block_tables(context_lens, block_size, num_blocks, gen)
    q = torch.randn(sum(query_lens), heads, width, generator=gen)
    width_table = max(len(t) for t in tables)
    table = torch.zeros(len(tables), width_table, dtype=torch.int32)
    for i, t in enumerate(tables):
        table[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    scale = width ** -0.5
    got = kernels.ops.decode_attention(q, cache, cache, table,
                                       torch.tensor(context_lens, dtype=torch.int32), scale, 128,
                                       2, torch.tensor(query_lens, dtype=torch.int32))
    start, want = 0, []
    for q_len, ctx, t in zip(query_lens, context_lens, tables):
        rows = cache[torch.tensor(t)].reshape(-1, width)[:ctx].float()
        qi = q[start:start + q_len]
        scores = torch.einsum("qhd,kd->hqk", qi, rows) * scale
        seen = torch.arange(ctx)[None, :] <= torch.arange(q_len)[:, None] + ctx - q_len
        probs = torch.softmax(scores.masked_fill(~seen, float("-inf")), -1)
        want.append(torch.einsum("hqk,kd->qhd", probs, rows))
        start += q_len
    want = torch.cat(want)
    if cache_dtype == torch.bfloat16 and kernels.ops.bf16_dot_products():
        err = (got - want).abs()
        assert err.max() < 8e-3 and err.mean() < 5e-4, (err.max(), err.mean())
    else:
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@ALL_THREADS
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ctx", [200, 300, 16])
def test_one_wide_request_splits_across_threads(kernels, cache_dtype, ctx):
    """One request whose context fits one split but is work enough (16 heads on one 320-wide
    row, as MLA's decode): with 2 threads the kernel cuts the context so each thread has a
    part, merged by log-sum-exp; the result equals the one-thread call (one split) up to float
    summation order (with AVX512-BF16 dot products for a bf16 cache, each split's
    probabilities are rounded to bf16 against its own maximum: bf16 rounding apart). A
    16-token context stays one item."""
    gen = torch.Generator().manual_seed(9)
    block_size, heads, width = 16, 16, 320
    num_blocks = -(-ctx // block_size) + 2
    cache = random_cache(gen, (num_blocks, block_size, 1, width), cache_dtype)
    table = torch.randperm(num_blocks, generator=gen)[: -(-ctx // block_size)].to(torch.int32)[None]
    q = torch.randn(1, heads, width, generator=gen)
    lens = torch.tensor([ctx], dtype=torch.int32)
    one = kernels.ops.decode_attention(q, cache, cache, table, lens, width ** -0.5, 512, 1)
    two = kernels.ops.decode_attention(q, cache, cache, table, lens, width ** -0.5, 512, 2)
    if cache_dtype == torch.bfloat16 and kernels.ops.bf16_dot_products():
        err = (two - one).abs()
        assert err.max() < 8e-3 and err.mean() < 5e-4
    else:
        torch.testing.assert_close(two, one, rtol=1e-5, atol=1e-5)


@ALL_THREADS
def test_many_rows_over_many_splits_take_fewer_longer_splits(kernels):
    """A verify step of 16 tokens x 64 heads over one wide latent row with 16-token splits
    would keep 128 splits' partial results (169 MB); the kernel takes fewer, longer splits
    (under 64 MB of partials) and the result still equals torch's."""
    gen = torch.Generator().manual_seed(11)
    block_size, heads, width, ctx, q_len = 16, 64, 320, 2048, 16
    num_blocks = ctx // block_size + 1
    cache = random_cache(gen, (num_blocks, block_size, 1, width), torch.float32)
    table = torch.randperm(num_blocks, generator=gen)[: ctx // block_size].to(torch.int32)[None]
    q = torch.randn(q_len, heads, width, generator=gen)
    got = kernels.ops.decode_attention(q, cache, cache, table, torch.tensor([ctx], dtype=torch.int32),
                                       width ** -0.5, 16, 2, torch.tensor([q_len], dtype=torch.int32))
    rows = cache[table[0].long()].reshape(-1, width)
    scores = torch.einsum("qhd,kd->hqk", q, rows) * width ** -0.5
    seen = torch.arange(ctx)[None, :] <= torch.arange(q_len)[:, None] + ctx - q_len
    want = torch.einsum("hqk,kd->qhd", torch.softmax(scores.masked_fill(~seen, float("-inf")), -1), rows)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_builds_the_cpu_does_not_list_are_not_compiled():
    from hearth.ops import build_kernels

    # no compiler runs: a build whose flags are missing returns before compiling
    result = build_kernels.build_and_probe("avx512amx", {"avx2", "fma", "f16c"})
    assert result["usable"] is False and result["path"] is None
    assert "amx_tile" in result["skipped"] and "avx512f" in result["skipped"]
    assert set(build_kernels.NEEDS) == set(build_kernels.VARIANTS)

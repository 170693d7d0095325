"""The scaled KV formats (hearth/ops/kv_quant.py): rows of int8 or fp8 (e4m3) values with their
float32 scale, the torch write and read paths, and the pool sizing, descriptor and tier-record
checks that carry them."""

import pytest
import torch

from hearth.models.arch import ModelArch
from hearth.engine.kv.transfer_api import KVCacheGeometry
from hearth.engine.parallel.layout import kv_bytes_per_block_per_rank
from hearth.kv_tiers.block_file import BlockRecordError, check_record, encode_header
from hearth.ops import kv_quant
from hearth.ops.attention import build_attention_metadata, write_kv
from tests.attention_steps import paged_attention

FP8 = torch.float8_e4m3fn
SCALED_KV = [torch.int8, FP8]


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)  # (fp8 tensors have no torch.equal)


def test_round_trip_is_within_half_a_step_of_each_row():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3, 64, generator=gen) * torch.rand(50, 3, 1, generator=gen) * 10
    rows = kv_quant.quantize(x)
    assert rows.dtype == torch.int8 and rows.shape == (50, 3, 68)
    step = x.abs().amax(-1, keepdim=True) / 127
    err = (kv_quant.dequantize(rows) - x).abs()
    assert (err <= step / 2 * (1 + 1e-5)).all()
    # the largest value of each row is exact (+-127 steps)
    assert kv_quant.dequantize(rows).abs().amax(-1).sub(x.abs().amax(-1)).abs().max() < 1e-5


def test_row_layout_is_values_then_the_float32_scale():
    x = torch.tensor([[0.0, 2.54, -1.27, 1.0]])
    rows = kv_quant.quantize(x)
    assert rows[0, :4].tolist() == [0, 127, -64, 50]  # -63.5 rounds half to even: -64
    assert rows[0, 4:].view(torch.float32).item() == pytest.approx(2.54 / 127)
    zero = kv_quant.quantize(torch.zeros(2, 8))  # an all-zero row: scale 0, values 0, no NaN
    assert zero.eq(0).all() and kv_quant.dequantize(zero).eq(0).all()


def test_fp8_round_trip_keeps_three_mantissa_bits_of_each_value():
    """e4m3 after scaling the row's largest value to 448: every value within half an e4m3 step
    (1/16 of itself, or 2^-10 of the scale in the subnormal range), the largest exact."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3, 64, generator=gen) * torch.rand(50, 3, 1, generator=gen) * 10
    rows = kv_quant.quantize(x, FP8)
    assert rows.dtype == FP8 and rows.shape == (50, 3, 68)
    scale = x.abs().amax(-1, keepdim=True) / 448
    err = (kv_quant.dequantize(rows) - x).abs()
    assert (err <= torch.maximum(x.abs() / 16, scale * 2**-10) * (1 + 1e-5)).all()
    assert kv_quant.dequantize(rows).abs().amax(-1).sub(x.abs().amax(-1)).abs().max() < 1e-5


def test_fp8_row_layout_rounds_ties_to_even():
    """scale 1 (the row's largest is 448): -100 lies halfway between -96 and -104, 1.0625
    between 1 and 1.125, 1.5 * 2^-9 between the subnormals 2^-9 and 2^-8; each goes to the
    even mantissa. Then the scale's 4 bytes."""
    x = torch.tensor([[0.0, 448.0, -100.0, 1.0625, 1.5 * 2**-9, -2.0**-6]])
    rows = kv_quant.quantize(x, FP8)
    assert rows[0, :6].float().tolist() == [0.0, 448.0, -96.0, 1.0, 2**-8, -(2.0**-6)]
    assert as_bytes(rows)[0, :6].tolist() == [0x00, 0x7E, 0xEC, 0x38, 0x02, 0x88]
    assert as_bytes(rows)[0, 6:].clone().view(torch.float32).item() == 1.0
    zero = kv_quant.quantize(torch.zeros(2, 8), FP8)  # an all-zero row: scale 0, no NaN
    assert as_bytes(zero).eq(0).all() and kv_quant.dequantize(zero).eq(0).all()


def test_as_cached_and_widen_follow_the_cache_dtype():
    x = torch.randn(4, 2, 16)
    assert kv_quant.as_cached(x, torch.float32) is x
    assert torch.equal(kv_quant.as_cached(x, torch.bfloat16), x.bfloat16().float())
    assert torch.equal(kv_quant.as_cached(x, torch.int8), kv_quant.dequantize(kv_quant.quantize(x)))
    assert kv_quant.row_width(64, torch.int8) == 68 and kv_quant.row_width(64, torch.bfloat16) == 64
    assert torch.equal(kv_quant.as_cached(x, FP8), kv_quant.dequantize(kv_quant.quantize(x, FP8)))
    assert kv_quant.row_width(64, FP8) == 68


@pytest.mark.parametrize("kv_dtype", SCALED_KV)
def test_torch_paths_attend_over_the_dequantized_cache(kv_dtype):
    """No kernels: a mixed step (a chunk after a cached prefix, a fresh prompt, decodes) over an
    int8 or fp8 cache equals the same step over a float32 cache holding the dequantized rows."""
    gen = torch.Generator().manual_seed(1)
    heads, kv_heads, dim, block_size, num_blocks = 6, 2, 32, 4, 40
    base = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    kc8, vc8 = kv_quant.quantize(base, kv_dtype), kv_quant.quantize(base.flip(0), kv_dtype)
    kcf, vcf = kv_quant.dequantize(kc8), kv_quant.dequantize(vc8)
    query_lens, context_lens = [5, 6, 1, 1], [13, 6, 1, 30]
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for ctx in context_lens:
        tables.append(perm[used: used + -(-ctx // block_size)])
        used += len(tables[-1])
    meta = build_attention_metadata(query_lens, context_lens, tables, block_size)
    q = torch.randn(sum(query_lens), heads, dim, generator=gen)
    k = torch.randn(sum(query_lens), kv_heads, dim, generator=gen)
    v = torch.randn(sum(query_lens), kv_heads, dim, generator=gen)
    got = paged_attention(q, k, v, kc8, vc8, meta, 0.2)
    want = paged_attention(q, kv_quant.as_cached(k, kv_dtype), kv_quant.as_cached(v, kv_dtype),
                           kcf, vcf, meta, 0.2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # what the step wrote: the new rows, quantized
    assert torch.equal(kv_quant.dequantize(kc8), kcf)
    fresh_k, fresh_v = torch.zeros_like(kc8), torch.zeros_like(vc8)
    write_kv(k, v, fresh_k, fresh_v, meta.slot_mapping)
    slots = fresh_k.view(-1, kv_heads, dim + 4)[meta.slot_mapping]
    assert torch.equal(as_bytes(slots), as_bytes(kv_quant.quantize(k, kv_dtype)))


@pytest.mark.parametrize("kv_dtype", SCALED_KV)
def test_a_scaled_block_takes_17_32nds_of_a_bf16_one(kv_dtype):
    arch = ModelArch("llama", vocab_size=100, hidden_size=576, intermediate_size=1536,
                     num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                     max_position_embeddings=8192)
    bf16 = kv_bytes_per_block_per_rank(arch, 1, 1, 16, 2)
    scaled = kv_bytes_per_block_per_rank(arch, 1, 1, 16, 1, kv_quant.scale_bytes(kv_dtype))
    assert scaled == 2 * 30 * 16 * 3 * 68 and scaled * 32 == bf16 * 17


@pytest.mark.parametrize("kv_dtype, name", [(torch.int8, "int8"), (FP8, "fp8_e4m3")])
def test_descriptors_and_tier_records_name_the_scaled_format(kv_dtype, name):
    """A cache's geometry names its format ("fp8_e4m3" fits the tier record's 8-byte field,
    torch's "float8_e4m3fn" would not); a record written by that cache reads back byte for
    byte, and a reader of the other scaled format -- same row width, same bytes per block --
    refuses it."""
    cache = torch.zeros(2, 2, 8, 16, 3, kv_quant.row_width(64, kv_dtype), dtype=kv_dtype)
    g = KVCacheGeometry.of(cache, 16)
    assert (g.dtype, g.head_dim, g.bytes_per_block) == (name, 68, 2 * 2 * 16 * 3 * 68)
    cache[:, :, 5] = kv_quant.quantize(torch.randn(2, 2, 16, 3, 64), kv_dtype)
    payload = memoryview(cache[:, :, 5].contiguous().view(-1).view(torch.uint8).numpy())
    record = memoryview(encode_header("ns", 9, g, payload) + bytes(payload))
    assert bytes(check_record(record, "ns", 9, g)) == bytes(payload)
    other = KVCacheGeometry.of(torch.zeros_like(cache.view(torch.uint8)).view(
        FP8 if kv_dtype == torch.int8 else torch.int8), 16)
    assert other.bytes_per_block == g.bytes_per_block and other.dtype != g.dtype
    with pytest.raises(BlockRecordError, match="another KV layout"):
        check_record(record, "ns", 9, other)


"""The int8 KV format (hearth/ops/kv_quant.py): rows of int8 values with their float32 scale,
the torch write and read paths, and the pool sizing and descriptor checks that carry it."""

import pytest
import torch

from hearth.models.arch import ModelArch
from hearth.engine.parallel.layout import kv_bytes_per_block_per_rank
from hearth.ops import kv_quant
from hearth.ops.attention import build_attention_metadata, paged_attention, write_kv


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


def test_as_cached_and_widen_follow_the_cache_dtype():
    x = torch.randn(4, 2, 16)
    assert kv_quant.as_cached(x, torch.float32) is x
    assert torch.equal(kv_quant.as_cached(x, torch.bfloat16), x.bfloat16().float())
    assert torch.equal(kv_quant.as_cached(x, torch.int8), kv_quant.dequantize(kv_quant.quantize(x)))
    assert kv_quant.row_width(64, torch.int8) == 68 and kv_quant.row_width(64, torch.bfloat16) == 64


def test_torch_paths_attend_over_the_dequantized_cache():
    """No kernels: a mixed step (a chunk after a cached prefix, a fresh prompt, decodes) over an
    int8 cache equals the same step over a float32 cache holding the dequantized rows."""
    gen = torch.Generator().manual_seed(1)
    heads, kv_heads, dim, block_size, num_blocks = 6, 2, 32, 4, 40
    base = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    kc8, vc8 = kv_quant.quantize(base), kv_quant.quantize(base.flip(0))
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
    want = paged_attention(q, kv_quant.as_cached(k, torch.int8), kv_quant.as_cached(v, torch.int8),
                           kcf, vcf, meta, 0.2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # what the step wrote: the new rows, quantized
    assert torch.equal(kv_quant.dequantize(kc8), kcf)
    fresh_k, fresh_v = torch.zeros_like(kc8), torch.zeros_like(vc8)
    write_kv(k, v, fresh_k, fresh_v, meta.slot_mapping)
    slots = fresh_k.view(-1, kv_heads, dim + 4)[meta.slot_mapping]
    assert torch.equal(slots, kv_quant.quantize(k))


def test_an_int8_block_takes_17_32nds_of_a_bf16_one():
    arch = ModelArch("llama", vocab_size=100, hidden_size=576, intermediate_size=1536,
                     num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                     max_position_embeddings=8192)
    bf16 = kv_bytes_per_block_per_rank(arch, 1, 1, 16, 2)
    int8 = kv_bytes_per_block_per_rank(arch, 1, 1, 16, 1, kv_quant.scale_bytes(torch.int8))
    assert int8 == 2 * 30 * 16 * 3 * 68 and int8 * 32 == bf16 * 17


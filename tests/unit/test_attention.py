"""The torch attention paths over the paged cache agree on what a token reads."""

import pytest
import torch

from hearth.ops.attention import build_attention_metadata
from tests.attention_steps import paged_attention

BLOCK = 4


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_a_prompt_reads_its_own_keys_as_the_cache_holds_them(cache_dtype):
    """Prefilling n tokens at once and prefilling n - 1 then decoding the last one give the
    last token the same attention output: with a bfloat16 cache the prompt's own fresh keys are
    rounded as the cache rounds them (otherwise a prefix hit or a recompute after preemption
    reads different K/V than the first pass did)."""
    gen = torch.Generator().manual_seed(0)
    n, heads, kv_heads, dim = 11, 6, 2, 16
    q = torch.randn(n, heads, dim, generator=gen)
    k = torch.randn(n, kv_heads, dim, generator=gen)
    v = torch.randn(n, kv_heads, dim, generator=gen)
    table = [3, 0, 2]

    def cache():
        return (torch.zeros(4, BLOCK, kv_heads, dim, dtype=cache_dtype),
                torch.zeros(4, BLOCK, kv_heads, dim, dtype=cache_dtype))

    kc, vc = cache()
    whole = paged_attention(q, k, v, kc, vc, build_attention_metadata([n], [n], [table], BLOCK),
                            scale=dim ** -0.5)
    kc, vc = cache()
    paged_attention(q[:-1], k[:-1], v[:-1], kc, vc,
                    build_attention_metadata([n - 1], [n - 1], [table], BLOCK), scale=dim ** -0.5)
    last = paged_attention(q[-1:], k[-1:], v[-1:], kc, vc,
                           build_attention_metadata([1], [n], [table], BLOCK), scale=dim ** -0.5)
    torch.testing.assert_close(whole[-1:], last, rtol=1e-5, atol=1e-5)


def masked_reference(q, k, v, prefix, scale):
    """Query i of a chunk sees keys [0, prefix + i]: one SDPA call with the mask written out."""
    rows = torch.arange(q.shape[0])[:, None] + prefix
    mask = torch.arange(k.shape[0])[None, :] <= rows
    o = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        attn_mask=mask, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)


@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (4, 4), (9, 3)])
@pytest.mark.parametrize("prefix,chunk", [(1, 7), (8, 13), (21, 5), (37, 2)])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_a_chunk_after_a_cached_prefix_attends_causally_with_the_offset(heads, kv_heads, prefix,
                                                                        chunk, cache_dtype):
    """A prefill chunk after `prefix` cached tokens (a prefix hit, or chunked prefill) reads
    every cached token and its own keys causally: equal to the written-out offset mask, over
    the keys as the cache holds them."""
    gen = torch.Generator().manual_seed(prefix * 100 + chunk)
    n, dim = prefix + chunk, 16
    q = torch.randn(n, heads, dim, generator=gen)
    k = torch.randn(n, kv_heads, dim, generator=gen)
    v = torch.randn(n, kv_heads, dim, generator=gen)
    num_blocks = -(-n // BLOCK)
    table = list(range(num_blocks))[::-1]  # blocks out of order, as the pool hands them out
    kc = torch.zeros(num_blocks, BLOCK, kv_heads, dim, dtype=cache_dtype)
    vc = torch.zeros(num_blocks, BLOCK, kv_heads, dim, dtype=cache_dtype)
    paged_attention(q[:prefix], k[:prefix], v[:prefix], kc, vc,
                    build_attention_metadata([prefix], [prefix], [table], BLOCK), scale=0.25)
    got = paged_attention(q[prefix:], k[prefix:], v[prefix:], kc, vc,
                          build_attention_metadata([chunk], [n], [table], BLOCK), scale=0.25)
    rounded_k, rounded_v = k.to(cache_dtype).float(), v.to(cache_dtype).float()
    want = masked_reference(q[prefix:], rounded_k, rounded_v, prefix, 0.25)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

"""The torch attention paths over the paged cache agree on what a token reads."""

import pytest
import torch

from hearth.ops.attention import build_attention_metadata, paged_attention

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

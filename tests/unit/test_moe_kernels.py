"""The MoE expert op (`moe_experts`, hearth/ops/csrc/moe.h) against the torch reference
(`hearth.models.moe.fused_experts_torch`): float and bf16 GEMM paths, every quantized format,
expert-parallel ranks (pairs of other ranks skipped), tokens that route nowhere locally, and
bad shapes. The router (`route_softmax`) against transformers' arithmetic."""

import pytest
import torch

from hearth.models.moe import fused_experts_torch, route_softmax
from hearth.models.quant import quantize_q8_0
from hearth.models.dequant import dequantize
from hearth.ops.cpu_kernels import QTYPE_IDS, pack_ggml
from tests.unit.test_cpu_kernels import ALL_THREADS, kernels, make_q4_blocks  # noqa: F401

E, H, I = 6, 64, 96


def make_case(num_tokens: int, top_k: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, H, generator=gen)
    w13 = torch.randn(E, 2 * I, H, generator=gen) / H ** 0.5
    w2 = torch.randn(E, H, I, generator=gen) / I ** 0.5
    weights, ids = route_softmax(torch.randn(num_tokens, E, generator=gen), top_k, True)
    return x, w13, w2, weights, ids


def test_router_is_softmax_then_top_k_then_renormalised():
    logits = torch.tensor([[1.0, 3.0, 2.0, -1.0]])
    weights, ids = route_softmax(logits, 2, renormalize=False)
    probs = logits.softmax(-1)
    assert ids.tolist() == [[1, 2]]
    torch.testing.assert_close(weights, probs[:, [1, 2]])
    weights, _ = route_softmax(logits, 2, renormalize=True)
    torch.testing.assert_close(weights, probs[:, [1, 2]] / probs[:, [1, 2]].sum())


@ALL_THREADS  # the experts split over threads
@pytest.mark.parametrize("num_tokens, top_k", [(1, 2), (3, 1), (17, 4), (40, 6)])
def test_float_path_equals_reference(kernels, num_tokens, top_k):
    x, w13, w2, weights, ids = make_case(num_tokens, top_k)
    want = fused_experts_torch(x, w13, w2, weights, ids)
    got = kernels.moe_experts(x, w13, w2, weights, ids, 0)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_bf16_weights_equal_reference_in_bf16(kernels):
    x, w13, w2, weights, ids = make_case(24, 2)
    w13, w2 = w13.bfloat16(), w2.bfloat16()
    want = fused_experts_torch(x.bfloat16(), w13, w2, weights, ids).float()
    got = kernels.moe_experts(x, w13, w2, weights, ids, 0)
    torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("start", [0, 3])
def test_expert_parallel_rank_adds_only_its_experts(kernels, start):
    x, w13, w2, weights, ids = make_case(9, 2)
    mine = slice(start, start + 3)  # this rank holds experts [start, start + 3)
    want = fused_experts_torch(x, w13[mine], w2[mine], weights, ids, expert_start=start)
    got = kernels.moe_experts(x, w13[mine].contiguous(), w2[mine].contiguous(), weights, ids,
                              start)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # the two ranks' parts sum to the whole layer
    other = slice(3 - start, 6 - start)
    total = got + kernels.moe_experts(x, w13[other].contiguous(), w2[other].contiguous(),
                                      weights, ids, 3 - start)
    torch.testing.assert_close(total, fused_experts_torch(x, w13, w2, weights, ids),
                               atol=1e-5, rtol=1e-5)


def test_no_local_pairs_gives_zeros(kernels):
    x, w13, w2, weights, ids = make_case(4, 2)
    got = kernels.moe_experts(x, w13[:1].contiguous(), w2[:1].contiguous(), weights, ids, 100)
    assert got.shape == (4, H) and not got.any()


def packed(fmt: str, w: torch.Tensor, gen, int8_act: bool = False):
    """(PackedWeight, its dequantized float rows) of `w` [rows, K] in `fmt`."""
    rows, k = w.shape
    if fmt == "q8_0":
        blocks = quantize_q8_0(w)
    else:
        blocks = make_q4_blocks(rows, k, fmt == "q4_1", gen)
    qtype = QTYPE_IDS[fmt]
    return (pack_ggml(qtype, blocks, int8_act),
            dequantize(blocks.reshape(-1), qtype, (rows, k)))


@ALL_THREADS
@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0"])
@pytest.mark.parametrize("num_tokens, top_k", [(1, 2), (5, 3), (16, 2)])
def test_quantized_path_equals_reference_on_dequantized_weights(kernels, fmt, num_tokens, top_k):
    gen = torch.Generator().manual_seed(1)
    x, w13, w2, weights, ids = make_case(num_tokens, top_k)
    q13, f13 = packed(fmt, w13.reshape(E * 2 * I, H), gen)
    q2, f2 = packed(fmt, w2.reshape(E * H, I), gen)
    f13, f2 = f13.reshape(E, 2 * I, H), f2.reshape(E, H, I)
    want = fused_experts_torch(x, f13, f2, weights, ids)
    got = kernels.moe_experts(x, f13, f2, weights, ids, 0, q13, q2)
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)


def test_bad_shapes_are_refused(kernels):
    x, w13, w2, weights, ids = make_case(3, 2)
    with pytest.raises(RuntimeError, match=r"w13 must be \[E, 2I, H\]"):
        kernels.moe_experts(x, w13[:, :5].contiguous(), w2, weights, ids, 0)
    with pytest.raises(RuntimeError, match="topk_ids .int64. and topk_weights must both be"):
        kernels.moe_experts(x, w13, w2, weights, ids.int(), 0)
    q13 = pack_ggml(QTYPE_IDS["q8_0"], quantize_q8_0(w13.reshape(-1, H)))
    with pytest.raises(RuntimeError, match="w2: qs does not match"):
        kernels.moe_experts(x, w13, w2, weights, ids, 0, q13, q13)


@pytest.mark.parametrize("renormalize", [True, False])
def test_moe_topk_equals_route_softmax_and_counts(kernels, renormalize):
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(33, E, generator=gen)
    counts = torch.zeros(E, dtype=torch.int64)
    weights, ids = kernels.ops.moe_topk(logits, 3, renormalize, counts)
    want_weights, want_ids = route_softmax(logits, 3, renormalize)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, atol=1e-6, rtol=1e-5)
    assert torch.equal(counts, torch.bincount(want_ids.flatten(), minlength=E))
    empty = torch.empty(0, dtype=torch.int64)
    kernels.ops.moe_topk(logits, 3, renormalize, empty)  # not counted
    with pytest.raises(RuntimeError, match="1 <= k <= E"):
        kernels.ops.moe_topk(logits, E + 1, renormalize, empty)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_qk_norm_rope_write_kv_equals_norms_then_rope(kernels, cache_dtype):
    """Qwen3's q/k norms fused ahead of rope_write_kv: the same as normalising q and k per head
    in fp32, then rope_write_kv."""
    gen = torch.Generator().manual_seed(4)
    heads, kv_heads, dim, tokens = 4, 2, 32, 5
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen)
    q_norm, k_norm = 1 + 0.1 * torch.randn(dim, generator=gen), 1 + 0.1 * torch.randn(dim, generator=gen)
    from hearth.models.layers import RotaryEmbedding
    rope = RotaryEmbedding(dim, 64, 10000.0, None)
    positions, slots = torch.tensor([3, 9, 10, 11, 40]), torch.tensor([7, 0, 1, 2, 5])

    def run(fused: bool):
        x = qkv.clone()
        caches = torch.zeros(2, 8, kv_heads, dim, dtype=cache_dtype)
        k_cache, v_cache = caches[0], caches[1]
        if fused:
            kernels.ops.qk_norm_rope_write_kv(x, positions, rope.cos, rope.sin, k_cache, v_cache,
                                              slots, heads, kv_heads, dim, q_norm, k_norm, 1e-6)
        else:
            view = x.view(tokens, -1, dim)
            for h in range(heads + kv_heads):
                w = q_norm if h < heads else k_norm
                v = view[:, h]
                view[:, h] = w * (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6))
            kernels.ops.rope_write_kv(x, positions, rope.cos, rope.sin, k_cache, v_cache, slots,
                                      heads, kv_heads, dim)
        return x, k_cache, v_cache

    for got, want in zip(run(True), run(False)):
        torch.testing.assert_close(got.float(), want.float(), atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="q_norm and k_norm must be float32"):
        kernels.ops.qk_norm_rope_write_kv(qkv.clone(), positions, rope.cos, rope.sin,
                                          torch.zeros(8, kv_heads, dim),
                                          torch.zeros(8, kv_heads, dim), slots, heads, kv_heads,
                                          dim, q_norm[:5], k_norm, 1e-6)


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0"])
def test_int8_activation_path_equals_reference_on_quantized_activations(kernels, fmt):
    """With 8-bit activations (the -a8 formats) each expert's input rows, and again the SiLU-mul
    rows, are quantized per 32-block before the integer dot products: the reference quantizes
    the same rows the same way and multiplies by the dequantized weights."""
    from tests.unit.test_cpu_kernels import quantize_activations

    gen = torch.Generator().manual_seed(2)
    x, w13, w2, weights, ids = make_case(5, 2)
    q13, f13 = packed(fmt, w13.reshape(E * 2 * I, H), gen, int8_act=True)
    q2, f2 = packed(fmt, w2.reshape(E * H, I), gen, int8_act=True)
    f13, f2 = f13.reshape(E, 2 * I, H), f2.reshape(E, H, I)
    want = torch.zeros(5, H)
    for t in range(5):
        for j in range(2):
            e = int(ids[t, j])
            gu = quantize_activations(x[t:t + 1]) @ f13[e].T
            act = torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]
            want[t] += weights[t, j] * (quantize_activations(act) @ f2[e].T)[0]
    got = kernels.moe_experts(x, f13, f2, weights, ids, 0, q13, q2)
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)



@pytest.mark.parametrize("fmt13, fmt2", [("q4_k", "q6_k"), ("q6_k", "q4_k")])
@pytest.mark.parametrize("num_tokens", [1, 7, 40])
def test_k_quant_experts_equal_reference_on_dequantized_weights(kernels, fmt13, fmt2, num_tokens):
    """Q4_K_M's expert stacks (Q4_K gate/up, Q6_K down in half the layers) in their own
    formats: the packed path gives the float op on the file's dequantized values, for a
    decode-sized step and a prompt-sized one (blocks-only experts run every step this way)."""
    from tests.unit.test_cpu_kernels import make_blocks
    gen = torch.Generator().manual_seed(num_tokens)
    e, h, inter, top_k = 4, 256, 256, 2
    x = torch.randn(num_tokens, h, generator=gen)
    weights, ids = route_softmax(torch.randn(num_tokens, e, generator=gen), top_k, True)
    b13, b2 = make_blocks(fmt13, e * 2 * inter, h, gen), make_blocks(fmt2, e * h, inter, gen)
    f13 = dequantize(b13.reshape(-1), QTYPE_IDS[fmt13], (e * 2 * inter, h)).view(e, 2 * inter, h)
    f2 = dequantize(b2.reshape(-1), QTYPE_IDS[fmt2], (e * h, inter)).view(e, h, inter)
    q13, q2 = pack_ggml(QTYPE_IDS[fmt13], b13), pack_ggml(QTYPE_IDS[fmt2], b2)
    want = fused_experts_torch(x, f13, f2, weights, ids)
    got = kernels.moe_experts(x, f13, f2, weights, ids, 0, q13, q2)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    # stand-ins of the stacks' shapes (strides 0) serve the packed path as well
    one = torch.zeros(1, 1, 1)
    same = kernels.moe_experts(x, one.expand(f13.shape), one.expand(f2.shape), weights, ids, 0,
                               q13, q2)
    assert torch.equal(same, got)
    if not torch.ops.hearth.kquant_superblock_act():  # there Q6_K takes 8-bit activations too
        with pytest.raises(RuntimeError, match="Q6_K experts take float32 activations"):
            kernels.moe_experts(x, f13, f2, weights, ids, 0, pack_ggml(QTYPE_IDS[fmt13], b13, True),
                                pack_ggml(QTYPE_IDS[fmt2], b2, True))


@pytest.mark.parametrize("fmt13, fmt2", [("q4_k", "q4_k"), ("q4_k", "q6_k"), ("q6_k", "q4_k")])
@pytest.mark.parametrize("num_tokens", [1, 6, 40])
def test_k_quant_experts_with_int8_activations_equal_reference(kernels, fmt13, fmt2, num_tokens):
    """K-quant expert stacks with 8-bit activations (the -a8 formats): the reference quantizes
    each expert's input rows, and again the SiLU-mul rows, as the build does (per 256 elements
    where K-quants meet them in whole super-blocks, else per 32; Q6_K stacks take 8-bit
    activations only there) and multiplies by the file's dequantized weights."""
    from tests.unit.test_cpu_kernels import make_blocks, quantize_activations
    superblock = torch.ops.hearth.kquant_superblock_act()
    if "q6_k" in (fmt13, fmt2) and not superblock:
        pytest.skip("this build's Q6_K takes float32 activations only")
    gen = torch.Generator().manual_seed(10 + num_tokens)
    e, h, inter, top_k = 4, 512, 256, 2
    span = 256 if superblock else 32
    x = torch.randn(num_tokens, h, generator=gen)
    weights, ids = route_softmax(torch.randn(num_tokens, e, generator=gen), top_k, True)
    b13, b2 = make_blocks(fmt13, e * 2 * inter, h, gen), make_blocks(fmt2, e * h, inter, gen)
    f13 = dequantize(b13.reshape(-1), QTYPE_IDS[fmt13], (e * 2 * inter, h)).view(e, 2 * inter, h)
    f2 = dequantize(b2.reshape(-1), QTYPE_IDS[fmt2], (e * h, inter)).view(e, h, inter)
    want = torch.zeros(num_tokens, h)
    for t in range(num_tokens):
        for j in range(top_k):
            k = int(ids[t, j])
            gu = quantize_activations(x[t:t + 1], span) @ f13[k].T
            act = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
            want[t] += weights[t, j] * (quantize_activations(act, span) @ f2[k].T)[0]
    got = kernels.moe_experts(x, f13, f2, weights, ids, 0, pack_ggml(QTYPE_IDS[fmt13], b13, True),
                              pack_ggml(QTYPE_IDS[fmt2], b2, True))
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3 * want.abs().max().item())


def routing_with_counts(counts: list[int], top_k: int, gen):
    """(weights, ids) [T, top_k] for T = sum(counts) / top_k tokens in which expert e takes
    exactly counts[e] pairs (each <= T: a token's experts are distinct), tokens shuffled so that
    a prefix of the tokens takes a share of each expert's pairs."""
    experts = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    num_tokens = len(experts) // top_k
    assert len(experts) == num_tokens * top_k and max(counts) <= num_tokens
    ids = experts.view(top_k, num_tokens).t()[torch.randperm(num_tokens, generator=gen)]
    weights = torch.rand(num_tokens, top_k, generator=gen) + 0.1
    return weights / weights.sum(-1, keepdim=True), ids.contiguous()


@ALL_THREADS
@pytest.mark.parametrize("fmt13, fmt2", [("q4_k", "q4_k"), ("q4_k", "q6_k"), ("q6_k", "q6_k")])
def test_k_quant_experts_with_int8_activations_at_every_pair_count(kernels, fmt13, fmt2):
    """Prompt steps of 1..300 tokens top-2 (to 600 pairs) with 8-bit activations: experts with
    kExpertGemmMinPairs (3) pairs or more take the AVX2 K-quant GEMM (csrc/moe.h, their rows
    quantized in its panel layout), fewer the tiles, in one step. Each token equals the
    reference on the same quantized activations and the file's dequantized weights, on 1 and 2
    threads; the whole step has experts of 0, 1, 2, 3, 4, 7, 8, 9, 33, 250 and 283 pairs.
    H = 768 and I = 768: 3 super-blocks per row (odd), 1536 gate|up rows (24 GEMM panels)."""
    from tests.unit.test_cpu_kernels import make_blocks, quantize_activations
    if not torch.ops.hearth.kquant_superblock_act():
        pytest.skip("this build's K-quants meet 8-bit activations per 32 elements (no GEMM)")
    gen = torch.Generator().manual_seed(42)
    counts = [0, 1, 2, 3, 4, 7, 8, 9, 33, 250, 283]
    e, h, inter, top_k = len(counts), 768, 768, 2
    weights, ids = routing_with_counts(counts, top_k, gen)
    num_tokens = ids.shape[0]
    x = torch.randn(num_tokens, h, generator=gen)
    b13, b2 = make_blocks(fmt13, e * 2 * inter, h, gen), make_blocks(fmt2, e * h, inter, gen)
    f13 = dequantize(b13.reshape(-1), QTYPE_IDS[fmt13], (e * 2 * inter, h)).view(e, 2 * inter, h)
    f2 = dequantize(b2.reshape(-1), QTYPE_IDS[fmt2], (e * h, inter)).view(e, h, inter)
    # each token's rows are quantized on their own, so one batch per expert is the reference.
    # An element of silu(gate) * up within 1e-3 of a step of a rounding tie may round the other
    # way in the kernel (its gate/up sums in another order): `slack` bounds what one step each
    # way of those elements moves the output by.
    want, slack = torch.zeros(num_tokens, h), torch.zeros(num_tokens, h)
    for k in range(1, e):  # expert 0 takes no pair
        tokens, slots = (ids == k).nonzero(as_tuple=True)
        gu = quantize_activations(x[tokens], 256) @ f13[k].T
        act = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
        w = weights[tokens, slots, None]
        want.index_add_(0, tokens, w * (quantize_activations(act, 256) @ f2[k].T))
        blocks = act.reshape(len(tokens), -1, 256)
        step = blocks.abs().amax(-1, keepdim=True) / 127
        scaled = blocks / torch.where(step > 0, step, 1)
        near = (scaled - scaled.floor() - 0.5).abs() < 1e-3
        slack.index_add_(0, tokens, w * ((near * step).reshape(act.shape) @ f2[k].abs().T))
    q13, q2 = pack_ggml(QTYPE_IDS[fmt13], b13, True), pack_ggml(QTYPE_IDS[fmt2], b2, True)
    q = [q13.qs, q13.d, q13.m, q2.qs, q2.d, q2.m]
    allowed = 1e-3 * (want.abs() + want.abs().max()) + slack
    for tokens in [*range(1, 25), 31, 40, 47, 64, 100, 161, 255, num_tokens]:
        for threads in (1, 2):
            got = torch.ops.hearth.moe_experts(
                x[:tokens], f13, f2, weights[:tokens], ids[:tokens], 0, q,
                [q13.qtype, q2.qtype], threads, True, None, None, 0, 1.702, 7.0)
            excess = (got - want[:tokens]).abs() - allowed[:tokens]
            assert excess.max() <= 0, (
                f"{tokens} tokens, {threads} threads: {int((excess > 0).sum())} elements off, "
                f"worst at {divmod(int(excess.argmax()), h)} by {excess.max().item():.4g}")


def make_gpt_oss_case(num_tokens: int, top_k: int, seed: int = 2):
    """A case with gpt-oss's extras: biases on gate/up and down, gate/up large enough that a
    limit of 1.5 cuts (both ends of up, the top of gate)."""
    x, w13, w2, weights, ids = make_case(num_tokens, top_k, seed)
    gen = torch.Generator().manual_seed(seed + 100)
    return (x, 2 * w13, w2, weights, ids, torch.randn(E, 2 * I, generator=gen),
            torch.randn(E, H, generator=gen))


SWIGLU = (1.702, 1.5)


@pytest.mark.parametrize("num_tokens, top_k", [(1, 2), (5, 3), (33, 4)])
def test_biases_and_clamped_swiglu_equal_reference(kernels, num_tokens, top_k):
    x, w13, w2, weights, ids, b13, b2 = make_gpt_oss_case(num_tokens, top_k)
    gate_up = torch.einsum("th,eih->tei", x, w13) + b13
    assert (gate_up[..., :I] > SWIGLU[1]).any() and (gate_up[..., I:].abs() > SWIGLU[1]).any()
    want = fused_experts_torch(x, w13, w2, weights, ids, b13=b13, b2=b2, swiglu=SWIGLU)
    got = kernels.moe_experts(x, w13, w2, weights, ids, 0, b13=b13, b2=b2, swiglu=SWIGLU)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    # each of them matters: without the clamp, or a bias, the answer is another
    for change in (dict(swiglu=(SWIGLU[0], 1e9)), dict(b13=None), dict(b2=None)):
        other = kernels.moe_experts(x, w13, w2, weights, ids, 0,
                                    **{**dict(b13=b13, b2=b2, swiglu=SWIGLU), **change})
        assert (other - want).abs().max() > 0.1


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
@pytest.mark.parametrize("int8_act", [False, True], ids=["f32", "a8"])
def test_quantized_path_takes_biases_and_clamped_swiglu(kernels, fmt, int8_act):
    gen = torch.Generator().manual_seed(3)
    x, w13, w2, weights, ids, b13, b2 = make_gpt_oss_case(7, 2)
    q13, f13 = packed(fmt, w13.reshape(E * 2 * I, H), gen, int8_act)
    q2, f2 = packed(fmt, w2.reshape(E * H, I), gen, int8_act)
    f13, f2 = f13.reshape(E, 2 * I, H), f2.reshape(E, H, I)
    want = fused_experts_torch(x, f13, f2, weights, ids, b13=b13, b2=b2, swiglu=SWIGLU)
    got = kernels.moe_experts(x, f13, f2, weights, ids, 0, q13, q2, b13=b13, b2=b2,
                              swiglu=SWIGLU)
    tol = 0.05 if int8_act else 1e-3
    torch.testing.assert_close(got, want, atol=tol * want.abs().max().item(), rtol=0)


@pytest.mark.parametrize("quantized", [False, True], ids=["float", "q8_0"])
def test_expert_parallel_ranks_split_biased_experts(kernels, quantized):
    """Each rank holds 3 whole experts with their biases; the two ranks' sums are the layer."""
    x, w13, w2, weights, ids, b13, b2 = make_gpt_oss_case(9, 2)
    parts = []
    for start in (0, 3):
        mine = slice(start, start + 3)
        args = (w13[mine].contiguous(), w2[mine].contiguous(), weights, ids, start)
        q = ()
        if quantized:
            q13 = pack_ggml(QTYPE_IDS["q8_0"], quantize_q8_0(args[0].reshape(-1, H)))
            q2 = pack_ggml(QTYPE_IDS["q8_0"], quantize_q8_0(args[1].reshape(-1, I)))
            q = (q13, q2)
        extras = dict(b13=b13[mine], b2=b2[mine], swiglu=SWIGLU)
        got = kernels.moe_experts(x, *args, *q, **extras)
        if not quantized:
            want = fused_experts_torch(x, *args[:2], weights, ids, start, **extras)
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
        parts.append(got)
    whole = fused_experts_torch(x, w13, w2, weights, ids, b13=b13, b2=b2, swiglu=SWIGLU)
    tol = 0.02 * whole.abs().max().item() if quantized else 1e-4
    torch.testing.assert_close(parts[0] + parts[1], whole, atol=tol, rtol=0)


def test_bad_biases_are_refused(kernels):
    x, w13, w2, weights, ids, b13, b2 = make_gpt_oss_case(3, 2)
    with pytest.raises(RuntimeError, match=r"b13 must be \[E, 2I\]"):
        kernels.moe_experts(x, w13, w2, weights, ids, 0, b13=b13[:, :5])
    with pytest.raises(RuntimeError, match=r"b2 must be \[E, H\]"):
        kernels.moe_experts(x, w13, w2, weights, ids, 0, b2=b2[:2])


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_experts_with_many_pairs_multiply_decoded_tiles(kernels, fmt):
    """Blocks-only experts take every step packed: an expert with more than 32 pairs in it runs
    on float tiles decoded from its blocks, the same values as the few-pair tiles."""
    gen = torch.Generator().manual_seed(6)
    x, w13, w2, weights, ids = make_case(100, 2)
    counts = torch.bincount(ids.flatten(), minlength=E)
    assert counts.max() > 32 and counts.min() <= 32  # decoded tiles and packed ones
    q13, f13 = packed(fmt, w13.reshape(E * 2 * I, H), gen)
    q2, f2 = packed(fmt, w2.reshape(E * H, I), gen)
    f13, f2 = f13.reshape(E, 2 * I, H), f2.reshape(E, H, I)
    want = fused_experts_torch(x, f13, f2, weights, ids)
    got = kernels.moe_experts(x, f13, f2, weights, ids, 0, q13, q2)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)

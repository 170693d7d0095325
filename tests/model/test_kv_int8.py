"""`--kv-cache-dtype int8|fp8` on the real default model: accuracy at a long-ish context, greedy
sanity, and the paths that move KV (PD transfer over TCP, a disk tier) carrying the scales.

Both formats keep a float32 scale inside every row (hearth/ops/kv_quant.py), so a block's
bytes are the whole of its KV: an imported or loaded block must equal the exported or evicted
one byte for byte, and a worker with another KV dtype must refuse the descriptor.
"""

import inspect
import json
import json.decoder
import textwrap
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from hearth.config import CacheConfig, EngineConfig, KVOffloadConfig, KVTransferConfig, ModelConfig
from hearth.kv_transfer.connector import DisaggConnector
from hearth.kv_tiers.store import make_store
from hearth.engine.kv.block_hash import hash_blocks
from hearth.engine.kv.transfer_api import KVTransfer
from hearth.engine.sampling_params import SamplingParams
from hearth.ops.cpu_kernels import available_variants
from tests.model.test_formats import NUM_NEW, agreement, teacher_forced_batch

pytestmark = pytest.mark.skipif(not available_variants(), reason="CPU kernels not built")
# --kv-cache-dtype -> (the cache's torch dtype, the name KV descriptors carry)
SCALED = {"int8": (torch.int8, "int8"), "fp8": (torch.float8_e4m3fn, "fp8_e4m3")}

GOLDEN = json.loads((Path(__file__).parent / "golden" / "smollm2_greedy.json").read_text())
CASES = GOLDEN["cases"]
LONG_SOURCE_TOKENS = 1000  # each long prompt: this much of a stdlib module's source + a question


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def runner(models, num_blocks: int = 160, **model_kw):
    cache = CacheConfig(num_blocks=num_blocks, kv_cache_dtype=model_kw.pop("kv_cache_dtype"))
    return models.executor(EngineConfig(model=ModelConfig(**model_kw), cache=cache))


@pytest.fixture(scope="module")
def long_reference(models):
    """Two held-out ~1.1k-token prompts (a stdlib module's source and a question about it), each
    with its fp32 greedy continuation and the fp32 logits at every scored position. The fp32
    reference runs hearth's kernels with float32 weights and KV (equal to plain torch to KL
    ~1e-8, test_formats), ~10x faster than the plain-torch path at this length."""
    llm = models.llm(quantization="none", kv_cache_dtype="float32")
    tok = llm.tokenizer
    ref_runner = runner(models, quantization="none", kv_cache_dtype="float32")
    prompts = []
    for module, question in ((textwrap, "What does this module do? Answer briefly."),
                             (json.decoder, "Which errors can this code raise, and when?")):
        source = tok.decode(tok.encode(inspect.getsource(module))[:LONG_SOURCE_TOKENS])
        prompts.append(tok.encode(tok.apply_chat_template(
            [{"role": "user", "content": f"```python\n{source}\n```\n{question}"}],
            add_generation_prompt=True)))
    gens = llm.generate(prompts, greedy(NUM_NEW))
    seqs = [(prompt + gen.token_ids, len(prompt)) for prompt, gen in zip(prompts, gens)]
    return [(tokens, n, logits)
            for (tokens, n), logits in zip(seqs, teacher_forced_batch(ref_runner, seqs))]


@pytest.mark.parametrize("fmt, min_top1, max_kl", [
    # measured here (2 x 25 positions after ~1.1k tokens): bf16 KV 1.000 / 6e-5 at 1.8k tokens;
    # int8 KV see docs/formats.md
    ({"quantization": "none", "kv_cache_dtype": "int8"}, 0.94, 2e-3),
    ({"quantization": "gguf", "kv_cache_dtype": "int8"}, 0.94, 2e-3),
    # fp8 measured 0.94 / 8.1e-3 (none), 0.94 / 8.4e-3 (gguf): ~9x int8's KL
    ({"quantization": "none", "kv_cache_dtype": "fp8"}, 0.9, 2e-2),
    ({"quantization": "gguf", "kv_cache_dtype": "fp8"}, 0.9, 2e-2),
])
def test_scaled_kv_agrees_with_fp32_at_long_context(models, long_reference, fmt, min_top1,
                                                    max_kl):
    """The prompt runs as one prefill chunk over the int8 / fp8 cache (prefill_attention reading
    its own quantized K/V), then every continuation token is a decode step (decode_attention)."""
    fast = runner(models, **fmt)
    top1, kl = agreement(long_reference, lambda seqs: teacher_forced_batch(fast, seqs))
    print(f"{fmt}: top-1 agreement {top1:.4f}, mean KL {kl:.2e}")
    assert top1 >= min_top1 and kl <= max_kl, (fmt, top1, kl)


# Where a case leaves the fp32 golden output, the fp32 model's top two tokens there are this
# close (nats): the 8-bit cache flipped a near-tie, not a confident token. Measured: int8 [40,
# 40, 31, 11, 20, 40, 40, 40] on an AVX2 EPYC, [40, 40, 31, 11, 20, 40, 40, 9] with the
# AVX-512 builds on a Zen 4 EPYC (case 2's 32nd token: a gap of 0.04, case 7's 10th: 0.14);
# fp8 [40, 40, 31, 2, 27, 2, 40, 9] (fp8's KL is ~7x int8's, test_formats), every flip within
# 0.5. The builds sum in different orders, so which near-ties flip differs by CPU; counting
# whole cases (at least 5 of 8) failed on Zen 4.
NEAR_TIE_NATS = 0.5


@pytest.mark.parametrize("kv_cache_dtype, min_prefix", [("int8", 8), ("fp8", 2)])
def test_greedy_scaled_kv_stays_with_the_reference_and_the_pool_is_whole(
        models, kv_cache_dtype, min_prefix):
    """Chunked prompts (32 tokens a step: chunks over a cached prefix) and batched decodes over
    the int8 / fp8 cache: each case follows the fp32 golden output for its first `min_prefix`
    tokens at least, leaves it only where the fp32 model's choice was a near-tie (its top two
    within NEAR_TIE_NATS, the 8-bit run's token one of them), and every block returns to the
    pool."""
    llm = models.llm(kv_cache_dtype=kv_cache_dtype, max_num_batched_tokens=32)
    outs = llm.generate([c["prompt_ids"] for c in CASES], greedy(GOLDEN["num_new"]))
    agree = []
    for case, out in zip(CASES, outs):
        want = case["output_ids"]
        agree.append(next((i for i, (a, b) in enumerate(zip(out.token_ids, want)) if a != b),
                          len(want)))
    print(f"{kv_cache_dtype}: tokens equal to the fp32 golden output per case: {agree}")
    assert min(agree) >= min_prefix, agree
    assert llm.engine.kv_pool_is_whole()
    left = [i for i, (a, c) in enumerate(zip(agree, CASES)) if a < len(c["output_ids"])]
    if not left:
        return
    # the fp32 model on the golden tokens up to each divergence: its top two there
    exact = models.llm(dtype="float32", prefill_dtype="float32", kv_cache_dtype="model")
    params = [SamplingParams(temperature=0.0, max_tokens=agree[i] + 1, ignore_eos=True, logprobs=2)
              for i in left]
    refs = exact.generate([CASES[i]["prompt_ids"] for i in left], params)
    for i, ref in zip(left, refs):
        at = agree[i]
        assert ref.token_ids[:at + 1] == CASES[i]["output_ids"][:at + 1]
        (first, lp1), (second, lp2) = ref.logprobs[at].top
        assert outs[i].token_ids[at] == second and lp1 - lp2 <= NEAR_TIE_NATS, \
            (i, at, ref.logprobs[at].top, outs[i].token_ids[at])


def make_pd_engine(models, role: str, kv_cache_dtype: str):
    config = replace(models.config(num_blocks=96, kv_cache_dtype=kv_cache_dtype),
                     kv_transfer=KVTransferConfig(role=role, secret="s", lease_seconds=30))
    return models.engine(config, connector_factory=lambda cfg, kv, g: DisaggConnector(cfg, kv, g))


def run(engine) -> dict:
    outs: dict = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    return outs


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_pd_moves_scaled_blocks_with_their_scales_and_refuses_another_dtype(models,
                                                                           kv_cache_dtype):
    """Prefill and decode workers both int8 (or both fp8), over TCP: the decode side computes
    none of the prompt, its imported blocks equal the prefill side's byte for byte (values and
    scales), and its greedy tokens equal a monolithic engine's of the same format. A bfloat16
    decode worker refuses the same descriptor before any block moves. Pools whole on every
    side."""
    torch_dtype, name = SCALED[kv_cache_dtype]
    prefill = make_pd_engine(models, "prefill", kv_cache_dtype)
    decode = make_pd_engine(models, "decode", kv_cache_dtype)
    bf16 = make_pd_engine(models, "decode", "bfloat16")
    mono = models.llm(kv_cache_dtype=kv_cache_dtype, num_blocks=96)
    try:
        ids = CASES[1]["prompt_ids"] + CASES[2]["prompt_ids"]  # 3+ full blocks
        prefill.add_request("a", ids, greedy(1), KVTransfer("prefill", transfer_id="t-a"))
        first = run(prefill)["a"][-1]
        d = first.kv_descriptor
        assert d.dtype == name and d.head_dim == 64 + 4
        spec = KVTransfer("decode", descriptor=d, first_token_id=first.new_token_ids[0])
        with pytest.raises(ValueError, match=f"{name}, this worker's bfloat16"):
            bf16.add_request("a", ids, greedy(8), spec)
        assert bf16.kv_pool_is_whole() and not bf16.has_unfinished()
        before = decode.stats().num_computed_prompt_tokens
        decode.add_request("a", ids, greedy(8), spec)
        outs = run(decode)["a"]
        assert decode.stats().num_computed_prompt_tokens == before
        tokens = first.new_token_ids + [t for o in outs for t in o.new_token_ids]
        [want] = mono.generate([ids], greedy(8))  # the first token counts
        assert tokens == want.token_ids
        for h in d.block_hashes:  # both sides keep the prompt's full blocks cached
            src = prefill.executor.kv_cache[:, :, prefill.pool.get_cached(h).block_id]
            dst = decode.executor.kv_cache[:, :, decode.pool.get_cached(h).block_id]
            assert src.dtype == torch_dtype
            assert torch.equal(src.view(torch.uint8), dst.view(torch.uint8))
        assert prefill.stats().num_leases_active == 0
        assert prefill.kv_pool_is_whole() and decode.kv_pool_is_whole()
    finally:
        for engine in (prefill, decode, bf16):
            engine.close()


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_a_disk_tier_loads_scaled_blocks_back_byte_for_byte(models, tmp_path, kv_cache_dtype):
    """An int8 (fp8) engine whose 20-block pool cannot hold two ~200-token prompts: the second
    pushes the first out to the disk tier, and running the first again loads its full blocks
    back (counted as cached) with the bytes they were evicted with, and the request then runs as
    over the same blocks cached in the pool. (Not token for token as the first run: there the
    prompt's last rows were computed in the same chunk as the rest, here after a cached prefix by
    another kernel, and fp8's 3-bit mantissa can round their K/V rows differently: on an AMX Xeon
    the fp8 output parted after ~8 tokens.)"""
    config = replace(models.config(num_blocks=20, kv_cache_dtype=kv_cache_dtype),
                     kv_offload=KVOffloadConfig(directory=str(tmp_path / "kv")))
    engine = models.engine(config, store_factory=make_store)
    a = [t for i in (0, 1, 2, 3) for t in CASES[i]["prompt_ids"]]
    b = [t for i in (4, 5, 6, 7) for t in CASES[i]["prompt_ids"]]

    def run_one(rid, ids):
        engine.add_request(rid, ids, greedy(12))
        outs = run(engine)[rid]
        deadline = time.monotonic() + 10
        while engine.tiers.store.counters["queue_depth"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert outs[-1].finished and outs[-1].error is None
        assert engine.kv_pool_is_whole()
        return [t for o in outs for t in o.new_token_ids], outs[-1].num_cached_tokens

    def block(h):  # [layers, 2, block_size, heads, 68] bytes of the block cached under h
        return engine.executor.kv_cache[:, :, engine.pool.get_cached(h).block_id].view(torch.uint8)

    try:
        first, _ = run_one("a1", a)
        evicted = {h: block(h).clone() for h in hash_blocks(a, 16)}
        run_one("b1", b)
        again, cached = run_one("a2", a)
        assert cached == (len(a) - 1) // 16 * 16  # every full block from the tier
        assert engine.stats().kv_tiers["disk"]["hits"] > 0
        for h, want in evicted.items():
            assert torch.equal(block(h), want)
        pooled, cached_in_pool = run_one("a3", a)  # the same blocks, now from the pool
        assert cached_in_pool == cached and again == pooled
        assert again[0] == first[0]
    finally:
        engine.close()

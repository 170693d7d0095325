"""Llama 4 and gpt-oss through the engine paths every family takes: PD transfer between two
engines over TCP on loopback, preemption under a pool too small for the batch (recompute), and
speculative decoding (n-gram and suffix drafts) -- each with greedy tokens equal to one plain
engine's in the exact formats, and pools whole afterwards.

The tiny checkpoints are the family tests' own (test_llama4.py, test_gpt_oss.py): Llama 4 with
chunked attention (chunk 32) on RoPE layers, NoPE layers, MoE and dense layers; gpt-oss with a
sliding window of 12 beside full layers, sinks and biased experts. Their prompts run past the
chunk / window, so the KV blocks a decode side receives, or recomputes after preemption, carry
those layers' limited attention.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from hearth.config import KVTransferConfig, SpeculativeConfig
from hearth.engine.engine import LLMEngine
from hearth.engine.kv.transfer_api import KVTransfer
from hearth.engine.llm import LLM, make_engine_config
from hearth.engine.sampling_params import SamplingParams
from hearth.kv_transfer.connector import DisaggConnector

transformers = pytest.importorskip("transformers")

from tests.model import test_gpt_oss, test_llama4  # noqa: E402 (after the importorskip)

FAMILIES = {"llama4": (test_llama4.make_llama4, test_llama4.PROMPTS),
            "gpt_oss": (test_gpt_oss.make_gpt_oss, test_gpt_oss.PROMPTS)}
EXACT = dict(dtype="float32", prefill_dtype="float32", kv_cache_dtype="model")
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SECRET = "test-secret"


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(name, checkpoint folder, prompts, one plain engine's greedy tokens per prompt)."""
    make, prompts = FAMILIES[request.param]
    folder = tmp_path_factory.mktemp(request.param) / "m"
    make(folder)
    llm = LLM(str(folder), **EXACT, max_num_batched_tokens=16)
    try:
        want = [c.token_ids for c in llm.generate(prompts, GREEDY)]
        assert llm.engine.kv_pool_is_whole()
    finally:
        llm.engine.close()
    return request.param, folder, prompts, want


def run(engine: LLMEngine) -> dict:
    outs: dict = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    return outs


def test_pd_transfer_gives_the_monolithic_tokens(family):
    """The prefill engine computes each prompt and its first token; the decode engine pulls
    every block over TCP, computes none of the prompt, and continues as one engine would."""
    _, folder, prompts, want = family
    base = make_engine_config(str(folder), **EXACT, max_num_batched_tokens=16, num_blocks=96)

    def engine(role: str) -> LLMEngine:
        config = replace(base, kv_transfer=KVTransferConfig(role=role, secret=SECRET,
                                                            lease_seconds=30))
        return LLMEngine(config, connector_factory=lambda cfg, kv, geometry:
                         DisaggConnector(cfg, kv, geometry))

    prefill, decode = engine("prefill"), engine("decode")
    try:
        for i, ids in enumerate(prompts):
            prefill.add_request(f"r{i}", ids, replace(GREEDY, max_tokens=1),
                                KVTransfer("prefill", transfer_id=f"x{i}"))
        firsts = {rid: outs[-1] for rid, outs in run(prefill).items()}
        assert all(f.error is None and f.kv_descriptor is not None for f in firsts.values())
        for i, ids in enumerate(prompts):
            first = firsts[f"r{i}"]
            decode.add_request(f"r{i}", ids, GREEDY, KVTransfer(
                "decode", descriptor=first.kv_descriptor, first_token_id=first.new_token_ids[0]))
        results = run(decode)
        for i, ids in enumerate(prompts):
            outs = results[f"r{i}"]
            assert outs[-1].error is None
            tokens = firsts[f"r{i}"].new_token_ids + [t for o in outs for t in o.new_token_ids]
            assert tokens == want[i]
            assert outs[-1].num_transferred_tokens == len(ids)
        assert decode.stats().num_computed_prompt_tokens == 0
        assert prefill.stats().num_leases_active == 0
        assert prefill.kv_pool_is_whole() and decode.kv_pool_is_whole()
    finally:
        prefill.close()
        decode.close()


def test_preemption_recomputes_to_the_same_tokens(family):
    """A pool of 12 blocks (192 tokens) for five requests needing ~240: requests are preempted
    and recomputed, through chunked prompts that cross the chunk / window edges again."""
    _, folder, prompts, want = family
    llm = LLM(str(folder), **EXACT, max_num_batched_tokens=16, num_blocks=12)
    try:
        got = [c.token_ids for c in llm.generate(prompts, GREEDY)]
        assert llm.engine.stats().num_preemptions > 0
        assert llm.engine.kv_pool_is_whole()
    finally:
        llm.engine.close()
    assert got == want


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_speculative_drafts_leave_greedy_tokens_unchanged(family, method):
    """Drafts verified in the target's steps (several tokens of a request in one step, across
    the chunk / window edges) accept only what the target would have sampled. The prompts run
    twice: on the second round the suffix drafter proposes the first round's outputs (a random
    model's own context rarely repeats, so n-gram drafts may not come up at all)."""
    _, folder, prompts, want = family
    llm = LLM(str(folder), **EXACT, max_num_batched_tokens=16,
              speculative=SpeculativeConfig(method=method, num_speculative_tokens=4))
    try:
        rounds = [[c.token_ids for c in llm.generate(prompts, GREEDY)] for _ in range(2)]
        stats = llm.engine.stats()
        assert llm.engine.kv_pool_is_whole()
    finally:
        llm.engine.close()
    assert rounds == [want, want]
    if method == "suffix":
        assert stats.num_spec_accepted_tokens > 0

"""Speculative decoding over MLA's latent cache (a tiny random DeepSeek-V3) equals plain greedy.

test_deepseek.py covers suffix drafts against transformers; here the other proposers: ngram
(prompt lookup) and a draft model (the model drafts for itself, so its own latent cache is
filled, rolled back and reused too), and ngram drafts on a decode worker whose prompt KV
arrived as latent blocks from a prefill worker. Each asserts that drafts were accepted (a run
without any would prove nothing) and that every pool ends whole.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from hearth.config import KVTransferConfig, SpeculativeConfig
from hearth.kv_transfer.connector import DisaggConnector
from hearth.engine.engine import LLMEngine
from hearth.engine.llm import LLM, make_engine_config
from hearth.engine.sampling_params import SamplingParams
from hearth.models.random_checkpoint import write_random_deepseek
from tests.model.test_kv_transfer import decode_all, prefill_all
from tests.model.test_moe import EXACT, PROMPTS

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_deepseek(tmp_path_factory) -> str:
    return str(write_random_deepseek(tmp_path_factory.mktemp("mla-spec") / "ds"))


@pytest.fixture(scope="module")
def reference(tiny_deepseek) -> list[list[int]]:
    llm = LLM(tiny_deepseek, **EXACT, num_blocks=64)
    try:
        return [c.token_ids for c in llm.generate(PROMPTS, GREEDY)]
    finally:
        llm.engine.close()


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_drafts_over_the_latent_cache_equal_greedy(tiny_deepseek, reference, method):
    spec = SpeculativeConfig(method=method, num_speculative_tokens=4, draft_num_blocks=64,
                             draft_model=tiny_deepseek if method == "draft" else None)
    llm = LLM(tiny_deepseek, **EXACT, num_blocks=64, speculative=spec)
    try:
        out = llm.generate(PROMPTS, GREEDY)
        assert [c.token_ids for c in out] == reference
        counters = llm.engine.speculator.counters
        assert counters.num_accepted_tokens > 0
        if method == "draft":  # the model drafting for itself: (nearly) all accepted
            assert counters.num_accepted_tokens >= 0.8 * counters.num_draft_tokens
            proposer = llm.engine.speculator.proposer
            assert proposer.kv.pool.is_whole() and not proposer.shadows
        assert llm.engine.kv_pool_is_whole()
    finally:
        llm.engine.close()


def test_decode_worker_drafts_after_importing_latent_blocks(tiny_deepseek, reference):
    def engine(role: str, method: str) -> LLMEngine:
        config = replace(make_engine_config(tiny_deepseek, **EXACT, num_blocks=64),
                         kv_transfer=KVTransferConfig(role=role, secret="s", lease_seconds=30),
                         speculative=SpeculativeConfig(method=method, num_speculative_tokens=4))
        return LLMEngine(config, connector_factory=DisaggConnector)

    prefill, decode = engine("prefill", "off"), engine("decode", "ngram")
    try:
        prompts = {f"p{i}": ids for i, ids in enumerate(PROMPTS)}
        firsts = prefill_all(prefill, prompts)
        results = decode_all(decode, prompts, firsts, GREEDY.max_tokens)
        for i, (rid, ids) in enumerate(prompts.items()):
            tokens, final = results[rid]
            assert tokens == reference[i], rid
            assert final.num_transferred_tokens == len(ids)
        assert decode.speculator.counters.num_accepted_tokens > 0
        assert prefill.kv_pool_is_whole() and decode.kv_pool_is_whole()
    finally:
        prefill.close()
        decode.close()

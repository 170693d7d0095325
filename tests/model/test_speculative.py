"""Speculative decoding leaves greedy output unchanged, token for token, in every mode.

The real default model in fp32 (the exact reference), speculation off against ngram and suffix,
on prompts whose answers copy from their context (so drafts are proposed and accepted, which
each test asserts: a test where nothing was drafted would prove nothing). The EAGLE-3 tests use
a random head, whose drafts are proposed and verified but almost never accepted.
"""

from __future__ import annotations

import pytest

from hearth.config import SpeculativeConfig
from hearth.engine.llm import LLM
from hearth.engine.sampling_params import GuidedSpec, SamplingParams
from hearth.models.eagle3_head import write_random_head

CODE = '''def area(width, height):
    """Return the area of a rectangle."""
    return width * height


def perimeter(width, height):
    """Return the perimeter of a rectangle."""
    return 2 * (width + height)
'''
PROMPTS = [
    f"Here is a file:\n{CODE}\nRewrite the file exactly, renaming width to w and height to h.",
    "Repeat this list exactly three times: red, green, blue, yellow, purple, orange.",
    f"Copy this code and add a docstring to the module:\n{CODE}",
    "Write the numbers from 1 to 30 separated by commas.",
]
METHODS = ["ngram", "suffix"]


def make_llm(models, method: str = "off", draft_model: str | None = None, **kw) -> LLM:
    kw.setdefault("num_blocks", 256)
    return models.llm(quantization="none", **kw, speculative=SpeculativeConfig(
        method=method, num_speculative_tokens=6, draft_model=draft_model))


def chat_ids(llm, prompt: str) -> list[int]:
    """`llm`: an LLM or an LLMEngine (anything with a tokenizer)."""
    return llm.tokenizer.encode(llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True))


def run(models, method: str, prompts=PROMPTS, params=None, **kw):
    llm = make_llm(models, method, **kw)
    params = params or SamplingParams(temperature=0.0, max_tokens=64)
    try:
        out = llm.generate([chat_ids(llm, p) for p in prompts], params)
        spec = llm.engine.speculator
        assert llm.engine.kv_pool_is_whole()
        return out, spec.counters if spec is not None else None
    finally:
        llm.engine.close()


@pytest.fixture(scope="module")
def reference(models):
    out, _ = run(models, "off")
    return [c.token_ids for c in out]


@pytest.mark.parametrize("method", METHODS)
def test_batched_greedy_output_is_unchanged(models, reference, method):
    out, counters = run(models, method)
    assert [c.token_ids for c in out] == reference
    assert counters.num_accepted_tokens > 0  # speculation really happened


@pytest.mark.parametrize("method", METHODS)
def test_one_at_a_time_with_prefix_hits_and_chunked_prefill(models, reference, method):
    llm = make_llm(models, method, max_num_batched_tokens=48)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=64)
        for prompt, want in zip(PROMPTS[:2], reference[:2]):
            for _ in range(2):  # the second run hits the prefix cache
                got = llm.generate([chat_ids(llm, prompt)], params)[0]
                assert got.token_ids == want
        assert got.cached_tokens > 0
        assert llm.engine.speculator.counters.num_accepted_tokens > 0
        assert llm.engine.kv_pool_is_whole()
    finally:
        llm.engine.close()


def test_preemption_under_a_small_pool(models, reference):
    out, counters = run(models, "suffix", num_blocks=24)
    assert [c.token_ids for c in out] == reference
    assert counters.num_accepted_tokens > 0


def test_stop_strings_max_tokens_and_logprobs_behave_as_without(models):
    params = SamplingParams(temperature=0.0, max_tokens=37, stop=["purple"], logprobs=2)
    prompts = PROMPTS[1:3]
    want, _ = run(models, "off", prompts, params)
    got, counters = run(models, "suffix", prompts, params)
    assert counters.num_accepted_tokens > 0
    for a, b in zip(want, got):
        assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
        assert [lp.token_id for lp in a.logprobs] == [lp.token_id for lp in b.logprobs]
        for x, y in zip(a.logprobs, b.logprobs):
            assert abs(x.logprob - y.logprob) < 1e-3
            assert [t for t, _ in x.top] == [t for t, _ in y.top]


def test_guided_requests_speculate_and_keep_their_grammar(models):
    schema = ('{"type": "object", "properties": {"colors": {"type": "array", "items": '
              '{"type": "string"}}}, "required": ["colors"]}')
    params = SamplingParams(temperature=0.0, max_tokens=64,
                            guided=GuidedSpec("json_schema", schema))
    prompts = ["List these colors as JSON: red, green, blue, red, green, blue, red, green."]
    want, _ = run(models, "off", prompts, params)
    got, counters = run(models, "suffix", prompts, params)
    assert got[0].token_ids == want[0].token_ids
    assert counters.num_draft_tokens > 0


@pytest.fixture(scope="module")
def eagle3_head(checkpoint, tmp_path_factory) -> str:
    """A random EAGLE-3 head of the default model's shapes (8k-token draft vocabulary)."""
    return str(write_random_head(tmp_path_factory.mktemp("eagle3"), checkpoint.arch,
                                 draft_vocab_size=8192))


def test_eagle3_random_head_batched_greedy_output_is_unchanged(models, reference, eagle3_head):
    """A random head's drafts are (nearly) all rejected: what this proves is that drafting
    from the target's hidden states and verifying leaves every request's tokens alone."""
    out, counters = run(models, "eagle3", draft_model=eagle3_head)
    assert [c.token_ids for c in out] == reference
    assert counters.num_draft_tokens > 0


def test_eagle3_guided_request_keeps_its_grammar(models, eagle3_head):
    schema = ('{"type": "object", "properties": {"colors": {"type": "array", "items": '
              '{"type": "string"}}}, "required": ["colors"]}')
    params = SamplingParams(temperature=0.0, max_tokens=64,
                            guided=GuidedSpec("json_schema", schema))
    prompts = ["List these colors as JSON: red, green, blue, red, green, blue, red, green."]
    want, _ = run(models, "off", prompts, params)
    got, counters = run(models, "eagle3", prompts, params, draft_model=eagle3_head)
    assert got[0].token_ids == want[0].token_ids
    assert counters.num_draft_tokens > 0


def test_sampled_requests_finish_and_release_everything(models):
    params = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=48, seed=i) for i in range(4)]
    out, counters = run(models, "suffix", PROMPTS, params)
    assert all(len(c.token_ids) > 0 and c.finish_reason in ("stop", "length") for c in out)
    assert counters.num_draft_tokens > 0


def test_draft_model_path_with_the_model_as_its_own_draft(models, reference):
    """The draft-model proposer behind the same interface: the default model drafts for itself
    (so nearly every draft is accepted) and the output is still the reference."""
    llm = models.llm(quantization="none", num_blocks=256, speculative=SpeculativeConfig(
        method="draft", draft_model="smollm2-135m-instruct", num_speculative_tokens=4,
        draft_num_blocks=128))
    try:
        params = SamplingParams(temperature=0.0, max_tokens=64)
        out = llm.generate([chat_ids(llm, p) for p in PROMPTS[:2]], params)
        assert [c.token_ids for c in out] == reference[:2]
        c = llm.engine.speculator.counters
        assert c.num_draft_tokens > 0 and c.num_accepted_tokens >= 0.8 * c.num_draft_tokens
        assert llm.engine.kv_pool_is_whole()
        proposer = llm.engine.speculator.proposer
        assert not proposer.shadows and proposer.kv.pool.is_whole()  # draft pool whole too
    finally:
        llm.engine.close()


def test_pd_decode_side_speculates_with_unchanged_output(models, reference):
    """A decode worker importing the prompt's KV from a prefill worker drafts and verifies as
    a monolithic one does: the same tokens as speculation off without PD."""
    from dataclasses import replace

    from hearth.config import KVTransferConfig
    from hearth.kv_transfer.connector import DisaggConnector
    from hearth.engine.kv.transfer_api import KVTransfer
    from hearth.engine.engine import LLMEngine

    def engine(role: str, method: str) -> LLMEngine:
        config = replace(models.config(num_blocks=256, quantization="none"),
                         kv_transfer=KVTransferConfig(role=role, secret="s", lease_seconds=30),
                         speculative=SpeculativeConfig(method=method, num_speculative_tokens=6))
        return models.engine(config, connector_factory=DisaggConnector)

    def run_engine(e: LLMEngine) -> dict:
        outs: dict = {}
        while e.has_unfinished():
            for out in e.step():
                outs.setdefault(out.request_id, []).append(out)
        return outs

    prefill, decode = engine("prefill", "off"), engine("decode", "suffix")
    try:
        prompts = {f"p{i}": chat_ids(decode, p)
                   for i, p in enumerate(PROMPTS[:2])}
        for rid, ids in prompts.items():
            prefill.add_request(rid, ids, SamplingParams(temperature=0.0, max_tokens=1),
                                KVTransfer("prefill", transfer_id=f"x-{rid}"))
        firsts = {rid: outs[-1] for rid, outs in run_engine(prefill).items()}
        for rid, ids in prompts.items():
            first = firsts[rid]
            decode.add_request(rid, ids, SamplingParams(temperature=0.0, max_tokens=64),
                               KVTransfer("decode", descriptor=first.kv_descriptor,
                                          first_token_id=first.new_token_ids[0]))
        results = run_engine(decode)
        for i, rid in enumerate(prompts):
            tokens = firsts[rid].new_token_ids + [t for o in results[rid] for t in o.new_token_ids]
            assert results[rid][-1].num_transferred_tokens == len(prompts[rid])
            assert tokens == reference[i]
        assert decode.speculator.counters.num_accepted_tokens > 0
        assert prefill.kv_pool_is_whole() and decode.kv_pool_is_whole()
    finally:
        prefill.close()
        decode.close()


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_tensor_and_pipeline_parallel_verify_drafts_like_one_process(tmp_path, tp, pp):
    """On T x P rank processes (a tiny random model that loops, so drafts get accepted) the
    sampler on the last stage verifies the drafts: tokens equal one process without them."""
    from hearth.models.random_checkpoint import write_random_checkpoint

    tiny = str(write_random_checkpoint(tmp_path / "tiny", num_layers=2, hidden_size=64,
                                       num_heads=4, num_kv_heads=2, intermediate_size=128,
                                       vocab_size=256))
    prompts = [[(5 * i + j % 7) % 250 + 3 for j in range(n)] for i, n in enumerate([9, 20, 33])]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=1)

    def generate(method: str, **kw):
        llm = LLM(tiny, num_blocks=64, speculative=SpeculativeConfig(method=method), **kw)
        try:
            out = llm.generate(prompts, params)
            assert llm.engine.kv_pool_is_whole()
            return out, llm.engine.speculator
        finally:
            llm.engine.close()

    want, _ = generate("off")
    got, spec = generate("ngram", tensor_parallel_size=tp, pipeline_parallel_size=pp)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert spec.counters.num_accepted_tokens > 0


def test_default_gguf_format_agrees_with_speculation_off(models):
    """In the default (GGUF, quantized) format verify steps run other kernels than single-token
    decodes (short-query attention, qlinear over 1 + k rows), so agreement is that format's
    own bar: here, the same greedy tokens on these prompts."""
    def generate(method: str):
        llm = models.llm(num_blocks=256, speculative=SpeculativeConfig(method=method))
        try:
            out = llm.generate([chat_ids(llm, p) for p in PROMPTS],
                               SamplingParams(temperature=0.0, max_tokens=64))
            return [c.token_ids for c in out], llm.engine.speculator
        finally:
            llm.engine.close()

    want, _ = generate("off")
    got, spec = generate("suffix")
    assert spec.counters.num_accepted_tokens > 0
    def agreeing_prefix(w, g) -> int:
        return next((i for i, (a, b) in enumerate(zip(w, g)) if a != b), min(len(w), len(g)))

    agreed = sum(agreeing_prefix(w, g) for w, g in zip(want, got))
    assert agreed / sum(len(w) for w in want) >= 0.99  # test_formats.py's top-1 bar for gguf

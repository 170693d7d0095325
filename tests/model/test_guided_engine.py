"""Grammar compiles run off the engine loop: a real engine on a tiny random model.

The tiny model's tokenizer has one token per word ("t0", "t1", ...) plus a few JSON characters.
A json_schema string with maxLength 1024 (within the default limits) unrolls into an automaton
with thousands of states and takes a good fraction of a second to compile, while a plain
request finishes in a few milliseconds of steps. Ordering is asserted on events the engine
reports (finished outputs, admissions), never on a clock.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from hearth.config import GuidedConfig
from hearth.engine.engine import LLMEngine
from hearth.engine.llm import make_engine_config
from hearth.engine.request import RequestStatus
from hearth.engine.sampling_params import GuidedSpec, SamplingParams
from hearth.models.random_checkpoint import write_random_checkpoint

SLOW = GuidedSpec("json_schema", '{"type": "string", "maxLength": 1024}')
SLOW_TOO = GuidedSpec("json_schema", '{"type": "string", "maxLength": 1023}')
PROMPT = [20, 21, 22, 23]
QUOTE = 3  # token id of '"' in the tokenizer below


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    folder = write_random_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny", num_layers=1)
    write_json_word_tokenizer(folder / "tokenizer.json", vocab_size=256)
    return str(folder)


def write_json_word_tokenizer(path, vocab_size: int) -> None:
    """Words "t0".."tN" (t2 is EOS), with ids 3.. spelling JSON characters."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = [f"t{i}" for i in range(vocab_size)]
    words[QUOTE:QUOTE + 8] = ['"', "a", "b", "{", "}", ":", ",", "1"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.save(str(path))


def make_engine(tiny: str, **guided) -> LLMEngine:
    config = make_engine_config(tiny, num_blocks=32)
    return LLMEngine(replace(config, guided=GuidedConfig(**guided)))


@pytest.fixture
def engine(tiny):
    engine = make_engine(tiny)
    yield engine
    engine.close()


def plain(max_tokens: int = 3) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def guided(spec: GuidedSpec, max_tokens: int = 4) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, guided=spec)


def run(engine: LLMEngine) -> tuple[list[tuple[str, str]], dict]:
    """Step until idle: the events in order ("admitted"/"rejected"/"finished", request id) and
    each request's finished output."""
    events, finished = [], {}
    while engine.has_unfinished():
        outputs = engine.step()
        events += [("rejected" if error else "admitted", rid) for rid, error in engine.admissions]
        for out in outputs:
            if out.finished:
                events.append(("finished", out.request_id))
                finished[out.request_id] = out
    return events, finished


def wait_compiles_done(engine: LLMEngine) -> None:
    pool = engine.grammar_pool()
    while pool.num_in_flight:
        pool.wait(1.0)


def test_plain_request_finishes_while_a_grammar_compiles(engine):
    slow = engine.add_request("slow", PROMPT, guided(SLOW))
    engine.add_request("plain", PROMPT, plain())
    assert slow.status is RequestStatus.WAITING_FOR_GRAMMAR
    assert slow.block_ids == [] and "slow" not in engine.scheduler.requests
    events, finished = run(engine)
    assert events == [("finished", "plain"), ("admitted", "slow"), ("finished", "slow")]
    assert finished["plain"].finish_reason == "length"
    assert slow.output_token_ids[0] == QUOTE and finished["slow"].error is None  # the grammar's
    assert engine.kv_pool_is_whole()


def test_identical_grammar_is_a_cache_hit(engine):
    engine.add_request("first", PROMPT, guided(SLOW))
    run(engine)
    pool = engine.grammar_pool()
    second = engine.add_request("second", PROMPT, guided(SLOW))
    assert second.grammar is not None and not engine.is_waiting_for_grammar("second")
    assert pool.counters["hits"] == 1 and pool.counters["misses"] == 1
    events, _ = run(engine)
    assert events == [("finished", "second")]  # straight to the scheduler, no admission step


def test_abort_while_compiling_leaves_everything_whole(tiny):
    engine = make_engine(tiny, num_compile_threads=1)
    try:
        engine.add_request("running", PROMPT, guided(SLOW))  # occupies the only thread
        engine.add_request("queued", PROMPT, guided(SLOW_TOO))  # waits behind it
        pool = engine.grammar_pool()
        assert pool.num_in_flight == 2
        engine.abort_request("queued")  # not started: its compile is cancelled
        assert pool.num_in_flight == 1 and pool.num_cached == 1
        engine.abort_request("running")  # started: the thread finishes it, nobody waits
        events, finished = run(engine)
        assert events == [("finished", "queued"), ("finished", "running")]
        assert {o.finish_reason for o in finished.values()} == {"abort"}
        wait_compiles_done(engine)
        assert pool.num_in_flight == 0 and pool.num_cached == 1  # the finished one is kept
        assert not engine.has_unfinished() and not engine.scheduler.requests
        assert engine.stats().num_waiting == 0 and engine.kv_pool_is_whole()
    finally:
        engine.close()


def test_compile_timeout_fails_only_that_request(tiny):
    engine = make_engine(tiny, compile_timeout_s=0.0)
    try:
        engine.add_request("slow", PROMPT, guided(SLOW))
        engine.add_request("plain", PROMPT, plain())
        events, finished = run(engine)
        assert ("rejected", "slow") in events and finished["plain"].finish_reason == "length"
        assert finished["slow"].finish_reason == "error"
        assert "did not compile within 0 s" in finished["slow"].error
        assert finished["slow"].error.startswith("response_format:")
        wait_compiles_done(engine)
        assert engine.kv_pool_is_whole()
    finally:
        engine.close()


def test_compiles_in_flight_are_bounded(tiny):
    engine = make_engine(tiny, max_compiles_in_flight=1)
    try:
        engine.add_request("a", PROMPT, guided(SLOW))
        with pytest.raises(ValueError, match="grammars are compiling"):
            engine.add_request("b", PROMPT, guided(SLOW_TOO))
        engine.add_request("c", PROMPT, guided(SLOW))  # the same grammar joins the compile
        events, finished = run(engine)
        assert sorted(finished) == ["a", "c"] and "b" not in engine.scheduler.requests
        assert not any(o.error for o in finished.values())
    finally:
        engine.close()


@pytest.mark.parametrize("spec, message", [
    (GuidedSpec("json_schema", '{"type": "string", "maxLength": 200000}'), "maxLength 200000"),
    (GuidedSpec("json_schema", '{"type": "array", "maxItems": 1e9}'), "maxItems"),
    (GuidedSpec("json_schema", '{"type": "string", "pattern": "^a{0,99999999999999}$"}'),
     "repetition"),
    (GuidedSpec("json_schema", '{"items": ' * 100 + "{}" + "}" * 100), "nested deeper"),
    (GuidedSpec("json_schema", "[" * 100000 + "]" * 100000), "over the limit of 131072"),
    (GuidedSpec("regex", "x{5000}"), "repetition"),
    (GuidedSpec("structural_tag", '{"properties": {' + ", ".join(
        f'"p{i}": {{"type": "string", "maxLength": 1000}}' for i in range(9)) + "}}"),
     "add up to 9000"),
])
def test_over_limit_specs_are_refused_before_compiling(engine, spec, message):
    with pytest.raises(ValueError, match=message):
        engine.add_request("big", PROMPT, guided(spec))
    assert not engine.has_unfinished() and engine.grammar_pool().num_in_flight == 0

"""Resuming a stream from the tokens already sent (`LLMEngine.add_request(output_token_ids=)`)
on the real default model: the resumed request continues exactly where the first one was cut.

Greedy: the whole output equals the uninterrupted one. Sampled with a seed: a draw is keyed by
(seed, output position), so the continuation is the same too, and at least the given prefix is
kept and the length is right. Grammar-constrained (json_schema, a tool call): the matcher is
advanced over the given tokens, so the result still parses. Refusals leave nothing behind.
"""

from __future__ import annotations

import json
from dataclasses import replace

import jsonschema
import pytest

from hearth.engine.engine import LLMEngine
from hearth.engine.refusals import RequestRejected
from hearth.engine.sampling_params import GuidedSpec, SamplingParams
from hearth.api.protocol import Tool
from hearth.server.tool_grammar import tool_choice_guidance
from hearth.server.tool_parsers import assemble, make_tool_parser

QUESTION = "Tell me about cats."
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3}},
    "required": ["name", "age", "tags"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def engine(models):
    engine = models.engine(models.config(num_blocks=96))
    yield engine
    engine.close()


def chat_prompt(engine: LLMEngine, content: str = QUESTION, tools=None) -> list[int]:
    text = engine.tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                                tools=tools, add_generation_prompt=True)
    return engine.tokenizer.encode(text)


def run(engine: LLMEngine, rid: str, prompt: list[int], params: SamplingParams,
        output_token_ids: list[int] = ()) -> dict:
    """One request to its end: every output's ids, text and logprobs, in order."""
    engine.add_request(rid, prompt, params, output_token_ids=list(output_token_ids))
    result = dict(ids=[], text="", logprobs=[], outputs=[], finish=None, stop_reason=None)
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id == rid and out.error is None
            result["ids"] += out.new_token_ids
            result["text"] += out.new_text
            result["logprobs"] += out.new_logprobs
            result["outputs"].append(out)
            if out.finished:
                result["finish"], result["stop_reason"] = out.finish_reason, out.stop_reason
                assert out.num_output_tokens == len(result["ids"])
    assert_idle(engine)
    return result


def assert_idle(engine: LLMEngine) -> None:
    assert engine.kv_pool_is_whole()
    assert not engine.has_unfinished() and not engine.scheduler.requests


@pytest.mark.parametrize("k", [1, 9, 19])
def test_greedy_resume_equals_the_uninterrupted_output(engine, k):
    prompt = chat_prompt(engine)
    params = SamplingParams(temperature=0.0, max_tokens=24, frequency_penalty=0.5)
    whole = run(engine, "whole", prompt, params)
    assert whole["finish"] == "length" and len(whole["ids"]) == 24
    resumed = run(engine, "resumed", prompt, params, whole["ids"][:k])
    assert resumed["ids"] == whole["ids"]  # penalties saw the given tokens
    assert resumed["text"] == whole["text"] and resumed["finish"] == "length"
    # the prefix cache serves the prompt and the given tokens (full blocks of 16, never the
    # last token); usage counts the prompt's hits only
    hits = (len(prompt) + k - 1) // 16 * 16
    assert resumed["outputs"][-1].num_cached_tokens == min(hits, len(prompt))
    first = resumed["outputs"][0]  # the given tokens come back first, as plain output
    assert first.new_token_ids == whole["ids"][:k] and not first.finished
    assert whole["text"].startswith(first.new_text)


def test_greedy_resume_on_a_fresh_engine_hits_nothing_and_still_matches(models, engine):
    prompt = chat_prompt(engine, "Name three rivers.")
    params = SamplingParams(temperature=0.0, max_tokens=16)
    whole = run(engine, "whole", prompt, params)
    fresh = models.engine(models.config(num_blocks=96))
    try:
        resumed = run(fresh, "resumed", prompt, params, whole["ids"][:5])
        assert resumed["ids"] == whole["ids"] and resumed["finish"] == whole["finish"]
        assert resumed["outputs"][-1].num_cached_tokens == 0
    finally:
        fresh.close()


def test_sampled_resume_keeps_the_given_tokens_and_the_length(engine):
    prompt = chat_prompt(engine)
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=20, ignore_eos=True)
    whole = run(engine, "whole", prompt, params)
    given = whole["ids"][:8]
    resumed = run(engine, "resumed", prompt, params, given)
    assert resumed["ids"][:8] == given
    assert len(resumed["ids"]) == 20 and resumed["finish"] == "length"
    # a seeded draw depends on (seed, position) alone: the continuation is the same one
    assert resumed["ids"] == whole["ids"]


def test_logprobs_of_given_tokens_are_placeholders_then_real(engine):
    prompt = chat_prompt(engine)
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=2)
    whole = run(engine, "whole", prompt, params)
    resumed = run(engine, "resumed", prompt, params, whole["ids"][:3])
    assert [lp.token_id for lp in resumed["logprobs"]] == whole["ids"]
    assert all(lp.logprob == 0.0 and lp.top == [(lp.token_id, 0.0)]
               for lp in resumed["logprobs"][:3])
    assert [round(lp.logprob, 4) for lp in resumed["logprobs"][3:]] == \
        [round(lp.logprob, 4) for lp in whole["logprobs"][3:]]


def test_given_tokens_that_already_end_the_output_finish_at_once(engine):
    prompt = chat_prompt(engine)
    full = run(engine, "whole", prompt, SamplingParams(temperature=0.0, max_tokens=6))
    again = run(engine, "again", prompt, SamplingParams(temperature=0.0, max_tokens=6),
                full["ids"])
    assert again["ids"] == full["ids"] and again["text"] == full["text"]
    assert again["finish"] == "length" and len(again["outputs"]) == 1
    # a stop string completed by the last given token, and EOS as the last given token
    stop = whole_text_word(full["text"])
    stopped = run(engine, "stop", prompt, SamplingParams(temperature=0.0, max_tokens=6,
                                                          stop=(stop,)))
    assert stopped["finish"] == "stop" and stopped["stop_reason"] == stop
    resumed = run(engine, "stop2", prompt, SamplingParams(temperature=0.0, max_tokens=6,
                                                           stop=(stop,)), stopped["ids"])
    assert (resumed["text"], resumed["finish"], resumed["stop_reason"]) == \
        (stopped["text"], "stop", stop)
    eos = engine.eos_token_ids[0]
    ended = run(engine, "eos", prompt, SamplingParams(temperature=0.0, max_tokens=6),
                full["ids"][:2] + [eos])
    assert ended["finish"] == "stop" and ended["ids"] == full["ids"][:2] + [eos]


def whole_text_word(text: str) -> str:
    """A word of `text` past its first token (a stop string the greedy output reaches)."""
    return text.split()[2]


def test_json_schema_resumed_mid_object_still_validates(models):
    spec = GuidedSpec("json_schema", json.dumps(SCHEMA))
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=120, guided=spec)
    first = models.engine(models.config(num_blocks=96))
    try:
        prompt = chat_prompt(first, "Describe a person as JSON with name, age and tags.")
        whole = run(first, "whole", prompt, params)
    finally:
        first.close()
    jsonschema.validate(json.loads(whole["text"]), SCHEMA)
    cut = len(whole["ids"]) // 2
    head = first.tokenizer.decode(whole["ids"][:cut])
    assert head.startswith("{") and not head.rstrip().endswith("}")  # inside the object
    # a fresh engine: its grammar is not compiled yet (the resume waits for it)
    second = models.engine(models.config(num_blocks=96))
    try:
        resumed = run(second, "resumed", prompt, replace(params, seed=99), whole["ids"][:cut])
    finally:
        second.close()
    assert resumed["ids"][:cut] == whole["ids"][:cut]
    jsonschema.validate(json.loads(resumed["text"]), SCHEMA)
    assert resumed["finish"] == "stop"


def tool_params(seed: int) -> SamplingParams:
    tools = [Tool.model_validate(t) for t in TOOLS]
    spec = tool_choice_guidance(tools, "required", True, "hermes")
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=80, guided=spec)


def parse_calls(text: str) -> list:
    parser = make_tool_parser("hermes")
    content, calls = assemble(parser.feed(text) + parser.finish())
    return calls


def test_tool_call_resumed_inside_the_arguments_is_still_a_valid_call(engine):
    prompt = chat_prompt(engine, "What is the weather in Paris?", tools=TOOLS)
    whole = run(engine, "whole", prompt, tool_params(3))
    [call] = parse_calls(whole["text"])
    args = json.loads(call.arguments)
    assert call.name == "get_weather" and set(args) == {"city", "unit"}
    # cut right after the city's opening quote: inside the arguments (the key was forced)
    ids = whole["ids"]
    cut = next(i for i in range(len(ids)) if '"city":"' in engine.tokenizer.decode(ids[:i]))
    assert cut < len(ids) - 5
    resumed = run(engine, "resumed", prompt, tool_params(11), ids[:cut])
    assert resumed["ids"][:cut] == ids[:cut]
    [call] = parse_calls(resumed["text"])
    args = json.loads(call.arguments)
    assert call.name == "get_weather" and args["unit"] in ("c", "f")
    assert isinstance(args["city"], str)


def test_refused_resumes_leave_nothing_behind(engine):
    prompt = chat_prompt(engine)
    plain = SamplingParams(temperature=0.0, max_tokens=8)
    whole = run(engine, "whole", prompt, plain)
    eos = engine.eos_token_ids[0]
    vocab = engine.arch.vocab_size
    cases = [
        (plain, [whole["ids"][0], vocab], "outside the vocabulary"),
        (plain, whole["ids"] + [whole["ids"][0]], "more than max_tokens"),
        (plain, [whole["ids"][0], eos, whole["ids"][1]], r"ends at position 1 \(stop\)"),
        (replace(plain, max_tokens=engine.max_model_len),
         [whole["ids"][0]] * (engine.max_model_len - len(prompt) + 1), "context length"),
    ]
    spec = GuidedSpec("json_schema", json.dumps(SCHEMA))
    brace = engine.tokenizer.encode("{")
    cases.append((replace(plain, guided=spec), brace + brace, "not allowed by the request's"))
    for i, (params, given, message) in enumerate(cases):
        with pytest.raises(RequestRejected, match=message) as info:
            engine.add_request(f"bad{i}", prompt, params, output_token_ids=given)
            run_to_end(engine)  # a guided one is refused when its grammar is ready
        assert info.value.param == "kv_transfer.output_token_ids"
        assert_idle(engine)
        assert f"bad{i}" not in engine.outputs
    assert run(engine, "after", prompt, plain)["ids"] == whole["ids"]  # the engine carries on


def run_to_end(engine: LLMEngine) -> None:
    """Step until idle; a grammar-wait rejection surfaces as the RequestRejected it carries."""
    while engine.has_unfinished():
        engine.step()
        for _, rejection in engine.admissions:
            if rejection is not None:
                raise RequestRejected(rejection.param, rejection.message, rejection.code)

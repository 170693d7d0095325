"""Jump-forward on the real default model: the forced tokens of a tool call enter as one chunk,
and the output is token-for-token the one the same grammar gives when the mask forces those
tokens one decode step each (jump_forward off). Greedy, so both runs see the same choices.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from hearth.config import GuidedConfig
from hearth.engine.engine import LLMEngine
from hearth.engine.sampling_params import SamplingParams
from hearth.api.protocol import NamedToolChoice, Tool
from hearth.server.tool_grammar import tool_choice_guidance

TOOLS = [
    {"type": "function", "function": {"name": "read_file", "description": "Read a file.",
     "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                    "required": ["path"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "edit", "description": "Replace text in a file.",
     "parameters": {"type": "object", "properties": {
         "path": {"type": "string"}, "old": {"type": "string"}, "new": {"type": "string"}},
         "required": ["path", "old", "new"], "additionalProperties": False}}},
]
QUESTION = "Open the file src/main.py and show it to me."


def make_engine(models, jump_forward: bool) -> LLMEngine:
    config = models.config(num_blocks=64)
    return models.engine(replace(config, guided=GuidedConfig(jump_forward=jump_forward)))


def params(choice, max_tokens: int = 64, logprobs: int | None = None) -> SamplingParams:
    tools = [Tool.model_validate(t) for t in TOOLS]
    if isinstance(choice, str) and choice != "required":
        choice = NamedToolChoice.model_validate({"type": "function", "function": {"name": choice}})
    spec = tool_choice_guidance(tools, choice, True, "hermes")
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, guided=spec, logprobs=logprobs)


def run(engine: LLMEngine, p: SamplingParams) -> dict:
    """Generate one tool call; count the steps that sampled a token for it (each outputs some)."""
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}],
                                                  tools=TOOLS, add_generation_prompt=True)
    engine.add_request("r", engine.tokenizer.encode(prompt), p)
    result = dict(ids=[], text="", logprobs=[], steps=0, finish=None)
    while engine.has_unfinished():
        for out in engine.step():
            result["steps"] += bool(out.new_token_ids)
            result["ids"] += out.new_token_ids
            result["text"] += out.new_text
            result["logprobs"] += out.new_logprobs
            if out.finished:
                result["finish"] = out.finish_reason
                assert out.error is None
    assert engine.kv_pool_is_whole()
    return result


@pytest.fixture(scope="module")
def engines(models):
    on, off = make_engine(models, True), make_engine(models, False)
    yield on, off
    on.close()
    off.close()


@pytest.mark.parametrize("choice", ["read_file", "edit", "required"])
def test_jump_forward_equals_masked_decoding_in_fewer_steps(engines, choice):
    on, off = engines
    forced_before = on.counters.forced
    fast, slow = run(on, params(choice)), run(off, params(choice))
    assert fast["ids"] == slow["ids"]
    assert fast["text"] == slow["text"] == on.tokenizer.decode(fast["ids"])
    assert fast["finish"] == slow["finish"] == "stop"
    num_forced = on.counters.forced - forced_before
    assert off.counters.forced == 0
    assert num_forced >= 15  # at least the wrapper <tool_call>\n{"name": ..., "arguments": {"
    assert fast["steps"] == slow["steps"] - num_forced  # one step per token not forced
    call = json.loads(fast["text"].removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))
    assert set(call) == {"name", "arguments"}
    if choice != "required":
        assert call["name"] == choice
    assert ", " not in json.dumps(call["arguments"], separators=(",", ":"))  # compact
    assert fast["text"].count(" ") == slow["text"].count(" ")


def test_forced_tokens_have_logprob_zero_and_the_same_values_as_masked(engines):
    on, off = engines
    fast, slow = run(on, params("read_file", logprobs=2)), run(off, params("read_file", logprobs=2))
    assert fast["ids"] == slow["ids"]
    assert len(fast["logprobs"]) == len(fast["ids"])
    for a, b in zip(fast["logprobs"], slow["logprobs"]):
        assert a.token_id == b.token_id
        assert a.logprob == pytest.approx(b.logprob, abs=1e-3)  # masked: the only choice, 0.0
    assert any(lp.logprob == 0.0 and lp.top == [(lp.token_id, 0.0)] for lp in fast["logprobs"])


@pytest.mark.parametrize("max_tokens", [1, 3, 12, 20])
def test_max_tokens_cuts_inside_a_forced_run(engines, max_tokens):
    on, off = engines
    fast, slow = run(on, params("edit", max_tokens)), run(off, params("edit", max_tokens))
    assert fast["ids"] == slow["ids"]
    assert len(fast["ids"]) == max_tokens
    assert fast["finish"] == slow["finish"] == "length"
    assert fast["text"] == on.tokenizer.decode(fast["ids"])


def test_a_stop_string_inside_the_forced_text_ends_there(engines):
    on, off = engines
    p = replace(params("read_file"), stop=['"arguments"'])
    fast, slow = run(on, p), run(off, p)
    assert fast["ids"] == slow["ids"]
    assert fast["text"] == slow["text"] == '<tool_call>\n{"name": "read_file", '
    assert fast["finish"] == "stop"


def test_seeded_sampling_gives_the_same_call_with_and_without_jump_forward(engines):
    """A seeded draw depends only on the seed and the output position, so the positions that
    jump-forward fills without drawing change no later draw."""
    on, off = engines
    sampled = [replace(params("edit"), temperature=1.0, seed=seed) for seed in (3, 4)]
    fast = [run(on, p) for p in sampled]
    slow = [run(off, p) for p in sampled]
    assert [r["ids"] for r in fast] == [r["ids"] for r in slow]
    assert fast[0]["ids"] != fast[1]["ids"]  # the seed decides the sampled arguments

"""Forced tokens (jump-forward) and compact tool-call JSON, on the small BPE of test_guided.

The contract: after a sampled token the matcher knows the tokens the grammar forces; with
jump-forward the engine appends them (`forced_token_ids`), without it the mask allows only the
next one. Either way the output is token-for-token the same.
"""

from __future__ import annotations

import json

import pytest
import torch

from hearth.engine.sampling_params import GuidedSpec
from hearth.api.protocol import NamedToolChoice, Tool
from hearth.server.tool_grammar import tool_choice_guidance
from tests.unit.test_guided import SmallTokenizer

WEATHER = {"type": "object", "properties": {"location": {"type": "string"}, "days": {"type": "integer"}},
           "required": ["location", "days"], "additionalProperties": False}
WRAPPER = '<tool_call>\n{"name": "get_weather", "arguments": '


@pytest.fixture(scope="module")
def tokenizer() -> SmallTokenizer:
    return SmallTokenizer()


@pytest.fixture(scope="module")
def compiler(tokenizer):
    # xgrammar (~0.9 s to import) only where a test compiles: each make-test worker collects
    # every file
    from hearth.engine.guided.grammar import GrammarCompiler

    return GrammarCompiler(tokenizer, vocab_size=tokenizer.vocab_size)


def named_call_spec(schema: dict = WEATHER) -> GuidedSpec:
    tools = [Tool.model_validate({"type": "function",
                                  "function": {"name": "get_weather", "parameters": schema}})]
    choice = NamedToolChoice.model_validate({"type": "function", "function": {"name": "get_weather"}})
    return tool_choice_guidance(tools, choice, True, "hermes")


def allowed(matcher) -> list[int]:
    return matcher.allowed_token_ids()


def test_forced_tokens_follow_a_sampled_token(compiler, tokenizer):
    matcher = compiler.matcher(named_call_spec())
    assert matcher.forced_token_ids() == []  # nothing was sampled yet: the model picks the first
    first = allowed(matcher)[0]
    assert matcher.accept(first)
    forced = matcher.forced_token_ids()
    assert len(forced) >= 3
    text = tokenizer.decode([first] + forced)
    # the wrapper and the first key are forced: compact JSON has no whitespace choice after "{"
    assert (WRAPPER + '{"location":"').startswith(text)
    assert len(text) > len(WRAPPER)
    for token in forced:
        assert allowed(matcher) == [token]  # each forced token is the only one allowed
        assert matcher.accept(token)
    assert matcher.forced_token_ids() == []  # the model chooses again (the location's text)


def test_a_token_other_than_the_forced_one_is_refused(compiler):
    matcher = compiler.matcher(named_call_spec())
    assert matcher.accept(allowed(matcher)[0])
    forced = matcher.forced_token_ids()
    others = [t for t in range(compiler.vocab_size) if t != forced[0]]
    assert not any(matcher.accept(t) for t in others[:50])
    assert matcher.forced_token_ids() == forced  # unchanged by the refusals


def test_without_jump_forward_the_mask_forces_the_same_tokens(compiler):
    matcher = compiler.matcher(named_call_spec())
    matcher.jump_forward = False
    assert matcher.accept(allowed(matcher)[0])
    assert matcher.forced_token_ids() == []  # not appended by the engine ...
    row = torch.zeros(compiler.vocab_size)
    matcher.fill_mask(row)
    assert torch.isfinite(row).sum() == 1  # ... but the only token the mask allows


def test_rollback_restores_the_forced_tokens(compiler):
    matcher = compiler.matcher(named_call_spec())
    assert matcher.accept(allowed(matcher)[0])
    forced = matcher.forced_token_ids()
    for token in forced[:2]:
        assert matcher.accept(token)
    assert matcher.forced_token_ids() == forced[2:]
    matcher.rollback(2)
    assert matcher.forced_token_ids() == forced
    matcher.rollback(1)
    assert matcher.forced_token_ids() == []


def test_tool_call_arguments_are_compact(compiler):
    matcher = compiler.matcher(named_call_spec())
    assert matcher.accept_text(WRAPPER)
    assert not matcher.accept_text('{ "location"')
    assert not matcher.accept_text('{"location": ')
    assert matcher.accept_text('{"location":"Oslo","days":3}}\n</tool_call>')
    assert matcher.is_complete()


def walk(compiler, spec, jump_forward: bool, seed: int) -> tuple[list[int], int]:
    """A random-logits walk as the engine drives it: (tokens, number of sampled tokens).
    Logits depend only on the position, so both modes see the same ones."""
    matcher = compiler.matcher(spec)
    matcher.jump_forward = jump_forward
    ids, num_sampled = [], 0
    while not matcher.is_terminated() and len(ids) < 300:
        generator = torch.Generator().manual_seed(seed * 1000 + len(ids))
        logits = torch.randn(compiler.vocab_size, generator=generator) * 3
        logits[128:] -= 20  # keep the walk mostly to short tokens so it ends
        matcher.fill_mask(logits)
        token = int(torch.argmax(logits))
        assert matcher.accept(token)
        ids.append(token)
        num_sampled += 1
        for forced in matcher.forced_token_ids():  # what the engine's hook does
            assert matcher.accept(forced)
            ids.append(forced)
    return ids, num_sampled


@pytest.mark.parametrize("seed", range(6))
def test_jump_forward_output_equals_the_masked_output(compiler, tokenizer, seed):
    spec = named_call_spec()
    on, num_sampled_on = walk(compiler, spec, True, seed)
    off, num_sampled_off = walk(compiler, spec, False, seed)
    assert on == off
    assert num_sampled_on < num_sampled_off  # the wrapper and the keys cost no step
    text = tokenizer.decode(on)
    assert text.startswith(WRAPPER) and text.endswith("}\n</tool_call>")
    arguments = json.loads(text[len(WRAPPER):-len("}\n</tool_call>")])
    assert set(arguments) == {"location", "days"}

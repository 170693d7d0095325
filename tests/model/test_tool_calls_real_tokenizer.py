"""Tool calls with the default model's real tokenizer (no weights): the grammar the server sends
for a forced call, walked with random logits, always parses back into a schema-valid call, and
the parser's result is the same for 1, 2 and 7 tokens per delta."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from hearth.config import DEFAULT_MODEL
from hearth.engine.guided.grammar import GrammarCompiler
from hearth.engine.text.tokenizer import Tokenizer
from hearth.models.loader import load_checkpoint
from hearth.api.protocol import NamedToolChoice, Tool
from hearth.server.tool_grammar import tool_choice_guidance
from hearth.server.tool_parsers import assemble, make_tool_parser

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer"},
                   "unit": {"enum": ["c", "f"]}},
    "required": ["city", "days", "unit"],
    "additionalProperties": False,
}
PING = {"type": "object", "properties": {}, "additionalProperties": False}
TOOLS = [Tool.model_validate({"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}),
         Tool.model_validate({"type": "function", "function": {"name": "ping", "parameters": PING}})]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_checkpoint(load_checkpoint(DEFAULT_MODEL))


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, load_checkpoint(DEFAULT_MODEL).arch.vocab_size)


def walk(compiler, tokenizer, spec, seed: int) -> list[int]:
    """Random logits under the mask until EOS; non-ASCII tokens are banned (see test_guided)."""
    non_ascii = torch.tensor([i for i in range(tokenizer.vocab_size) if not tokenizer.decode([i]).isascii()])
    matcher, generator, ids = compiler.matcher(spec), torch.Generator().manual_seed(seed), []
    for _ in range(400):
        logits = torch.randn(compiler.vocab_size, generator=generator) * 3
        logits[non_ascii] = float("-inf")
        matcher.fill_mask(logits)
        token = int(torch.argmax(logits))
        assert matcher.accept(token)
        if token in tokenizer.eos_token_ids:
            return ids
        ids.append(token)
    raise AssertionError("no EOS")


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_call_grammar_parses_back_valid_for_any_delta_size(compiler, tokenizer, parser, choice):
    tool_choice = "required" if choice == "required" else NamedToolChoice.model_validate(
        {"function": {"name": "get_weather"}})
    spec = tool_choice_guidance(TOOLS, tool_choice, True, parser)
    for seed in range(3):
        ids = walk(compiler, tokenizer, spec, seed)
        results = []
        for tokens_per_delta in (1, 2, 7):
            tool_parser = make_tool_parser(parser, make_call_id=lambda: "call_x")
            events = []
            for at in range(0, len(ids), tokens_per_delta):
                events += tool_parser.feed(tokenizer.decode(ids[at : at + tokens_per_delta]))
            results.append(assemble(events + tool_parser.finish()))
        assert results[0] == results[1] == results[2]
        content, calls = results[0]
        assert content is None and len(calls) == 1
        if choice == "named":
            assert calls[0].name == "get_weather"
        schema = SCHEMA if calls[0].name == "get_weather" else PING
        jsonschema.validate(json.loads(calls[0].arguments), schema)

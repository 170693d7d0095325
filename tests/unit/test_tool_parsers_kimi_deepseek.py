"""Kimi K2 and DeepSeek V3 / V3.1 tool calls: the parsers (the result never depends on how the text
is split), the grammars that force a call (walked on a small BPE that has the markers as special
tokens), `auto` picking the format from a template, and calls rendering back through a template."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models

from hearth.engine.text.tokenizer import Tokenizer
from hearth.api.chat_prompt import render_chat_prompt
from hearth.api.protocol import ChatMessage, NamedToolChoice, Tool
from hearth.server.tool_grammar import tool_choice_guidance
from hearth.server.tool_parsers import (
    TOOL_PARSERS,
    ToolCallDelta,
    assemble,
    make_tool_parser,
    tool_parser_for_template,
)
from hearth.server.tool_parsers import SECTION_MARKUPS
from tests.tool_markup import MARKERS, chat_template
from tests.unit.test_guided import SmallTokenizer
from tests.unit.test_tool_parsers import check_stream_shape, make_ids, run, split_every, split_random

K_SEC, K_SEC_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
K_CALL, K_ARGS, K_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
D_SEC, D_SEC_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
D_CALL, D_SEP, D_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"


def kimi(name: str, args: str, index: int = 0) -> str:
    return f"{K_CALL}functions.{name}:{index}{K_ARGS}{args}{K_END}"


def v3(name: str, args: str) -> str:
    return f"{D_CALL}function{D_SEP}{name}\n```json\n{args}\n```{D_END}"


def v31(name: str, args: str) -> str:
    return f"{D_CALL}{name}{D_SEP}{args}{D_END}"


# (parser, output text, expected content, expected [(id or None, name, arguments)]); id None: random
CASES = [
    ("kimi_k2", K_SEC + kimi("get_weather", '{"city": "Paris", "days": 3}') + K_SEC_END, None,
     [("functions.get_weather:0", "get_weather", '{"city": "Paris", "days": 3}')]),
    # content first, whitespace around markers, marker text inside a JSON string, two calls
    ("kimi_k2", "Let me check.\n" + K_SEC + "\n" + kimi("a", '{"x": "}{<|tool_call_e"}', 3) + "\n"
     + kimi("b", '{"y": [1, {"z": "\\"q"}]}', 4) + "\n" + K_SEC_END, "Let me check.",
     [("functions.a:3", "a", '{"x": "}{<|tool_call_e"}'), ("functions.b:4", "b", '{"y": [1, {"z": "\\"q"}]}')]),
    # the singular section spelling; a call with no index gets one; empty and string arguments
    ("kimi_k2", "<|tool_call_section_begin|>" + f"{K_CALL}functions.f{K_ARGS}{K_END}"
     + kimi("g", '"{\\"a\\": 1}"', 1) + "<|tool_call_section_end|>", None,
     [("functions.f:0", "f", "{}"), ("functions.g:1", "g", '{"a": 1}')]),
    # a call without its section is still a call; text after it is content (the space around
    # a call is dropped, as with hermes)
    ("kimi_k2", "Sure. " + kimi("f", "{}") + " Done.", "Sure.Done.", [("functions.f:0", "f", "{}")]),
    # a call missing its end marker ends at the next call; a stray marker in text is dropped
    ("kimi_k2", K_END + "Hi " + K_SEC + K_CALL + "functions.a:0" + K_ARGS + '{"k": 1}'
     + kimi("b", "{}", 1) + K_SEC_END, "Hi", [("functions.a:0", "a", '{"k": 1}'), ("functions.b:1", "b", "{}")]),
    # cut off mid-arguments: reported with what was produced; before its arguments: dropped
    ("kimi_k2", "Checking. " + K_SEC + K_CALL + "functions.read_file:0" + K_ARGS + '{"path": "src/ma',
     "Checking.", [("functions.read_file:0", "read_file", '{"path": "src/ma')]),
    ("kimi_k2", "Checking. " + K_SEC + K_CALL + "functions.read_fi", "Checking.", []),
    ("kimi_k2", "An answer <|tool_calls_sec", "An answer", []),  # a marker cut off: markup
    ("kimi_k2", "1 <", "1 <", []),
    ("kimi_k2", "Plain text, no calls.", "Plain text, no calls.", []),
    # a call that ends before its arguments is dropped; the next one stands
    ("kimi_k2", K_SEC + K_CALL + "functions.f:0" + K_END + kimi("g", "{}", 1) + K_SEC_END, None,
     [("functions.g:1", "g", "{}")]),
    ("deepseek_v3", D_SEC + v3("get_weather", '{"city": "Paris"}') + D_SEC_END, None,
     [(None, "get_weather", '{"city": "Paris"}')]),
    ("deepseek_v3", "I will look both up.\n\n" + D_SEC + v3("a", '{"q": "```json\\n{}"}') + "\n"
     + v3("b", '{"n": [1, 2]}') + D_SEC_END, "I will look both up.",
     [(None, "a", '{"q": "```json\\n{}"}'), (None, "b", '{"n": [1, 2]}')]),
    ("deepseek_v3", D_SEC + D_CALL + "function" + D_SEP + "edit\n```json\n{\"path\": \"a.py\", \"old\"",
     None, [(None, "edit", '{"path": "a.py", "old"')]),
    ("deepseek_v3", "Text with a fence:\n```json\n{}\n```", "Text with a fence:\n```json\n{}\n```", []),
    ("deepseek_v31", D_SEC + v31("get_weather", '{"city":"Oslo"}') + v31("ping", "{}") + D_SEC_END,
     None, [(None, "get_weather", '{"city":"Oslo"}'), (None, "ping", "{}")]),
    ("deepseek_v31", "Hmm. " + D_SEC + v31("f", '{"s": "<｜tool▁sep｜> inside"}') + D_SEC_END + "\n",
     "Hmm.", [(None, "f", '{"s": "<｜tool▁sep｜> inside"}')]),
    ("deepseek_v31", "Hmm. " + D_SEC + D_CALL + "get_wea", "Hmm.", []),
]


@pytest.mark.parametrize("parser, text, content, calls", CASES)
@pytest.mark.parametrize("split", ["whole", 1, 2, 3, 7, "random"])
def test_result_is_independent_of_delta_size(parser, text, content, calls, split):
    if split == "whole":
        pieces = [text]
    elif split == "random":
        pieces = split_random(text, seed=len(text))
    else:
        pieces = split_every(text, split)
    events = run(parser, pieces)
    check_stream_shape(events)  # one header delta per call, then non-empty argument fragments
    assert all(e for e in events if isinstance(e, str))  # no empty content deltas
    got_content, got_calls = assemble(events)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got_calls] == [(name, args) for _, name, args in calls]
    random_ids = iter(f"call_{i}" for i in range(len(calls)))
    assert [c.id for c in got_calls] == [i if i is not None else next(random_ids) for i, _, _ in calls]
    for marker in MARKERS[parser]:
        assert marker not in (got_content or "")


def test_kimi_header_goes_out_when_the_arguments_begin_and_content_streams_first():
    parser = make_tool_parser("kimi_k2", make_ids())
    assert parser.feed("Let me look <|tool_c") == ["Let me look"]  # the rest may be a marker
    assert parser.feed("alls_section_begin|><|tool_call_begin|>functions.search:2") == []
    assert parser.feed("<|tool_call_argument_begin|>") == []
    assert parser.feed('{"q": "ca') == [ToolCallDelta(0, id="functions.search:2", name="search"),
                                        ToolCallDelta(0, arguments='{"q": "ca')]
    assert parser.feed('ts"}<|tool_call_e') == [ToolCallDelta(0, arguments='ts"}')]
    assert parser.feed("nd|><|tool_calls_section_end|>") == []
    assert parser.finish() == []
    assert parser.num_calls == 1 and parser.num_dropped == 0


def test_deepseek_v3_fence_after_the_arguments_is_not_streamed():
    parser = make_tool_parser("deepseek_v3", make_ids())
    events = parser.feed(D_SEC + D_CALL + "function" + D_SEP + "f\n```json\n{\"a\": 1}\n``")
    assert events == [ToolCallDelta(0, id="call_0", name="f"), ToolCallDelta(0, arguments='{"a": 1}')]
    assert parser.feed("`" + D_END + D_SEC_END) == [] and parser.finish() == []


def test_auto_picks_the_format_the_template_writes():
    for parser in SECTION_MARKUPS:
        assert tool_parser_for_template(chat_template(parser)) == parser
    assert tool_parser_for_template("{{ '<|start_header_id|>' }}") == "llama3_json"
    assert tool_parser_for_template("<|im_start|>") == "hermes"
    assert set(SECTION_MARKUPS) <= set(TOOL_PARSERS)


# -- grammars -----------------------------------------------------------------------------------

LOCATION = {"type": "object", "properties": {"location": {"type": "string", "maxLength": 10},
                                             "days": {"type": "integer"}},
            "required": ["location", "days"], "additionalProperties": False}
PING = {"type": "object", "properties": {}, "additionalProperties": False}
TOOLS = [Tool.model_validate({"type": "function", "function": {"name": "get_weather", "parameters": LOCATION}}),
         Tool.model_validate({"type": "function", "function": {"name": "ping", "parameters": PING}})]
NAMED = NamedToolChoice.model_validate({"type": "function", "function": {"name": "get_weather"}})


class MarkerTokenizer(SmallTokenizer):
    """test_guided's small BPE plus the formats' markers as special tokens (as in the models)."""

    def __init__(self) -> None:
        super().__init__()
        self.backend.add_special_tokens(sorted({m for ms in MARKERS.values() for m in ms}))
        self.vocab_size = self.backend.get_vocab_size(with_added_tokens=True)
        self.marker_ids = [self.backend.token_to_id(m) for ms in MARKERS.values() for m in ms]

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids, skip_special_tokens=False)


@pytest.fixture(scope="module")
def tokenizer() -> MarkerTokenizer:
    return MarkerTokenizer()


@pytest.fixture(scope="module")
def compiler(tokenizer):
    # xgrammar (~0.9 s to import) only where a test compiles: each make-test worker collects
    # every file
    from hearth.engine.guided.grammar import GrammarCompiler

    return GrammarCompiler(tokenizer, vocab_size=tokenizer.vocab_size)


def walk(compiler, tokenizer, spec, seed: int) -> tuple[list[int], int]:
    """Random logits under the mask, forced tokens appended as the engine does, until EOS:
    (token ids, number of sampled tokens). ASCII tokens only (see test_guided), and a marker token
    first or where nothing else is allowed, as a model trained on the markers writes them (the
    grammar would also allow one inside a JSON string, which a marker then cuts short)."""
    ascii_ids = torch.tensor([i for i in range(tokenizer.vocab_size) if tokenizer.decode([i]).isascii()])
    matcher, generator = compiler.matcher(spec), torch.Generator().manual_seed(seed)
    ids, num_sampled = [], 0
    for _ in range(300):
        logits = torch.full((compiler.vocab_size,), float("-inf"))
        logits[ascii_ids] = torch.randn(len(ascii_ids), generator=generator) * 3
        logits[tokenizer.marker_ids] = 50.0 if not ids else -1e4
        matcher.fill_mask(logits)
        token = int(torch.argmax(logits))
        assert matcher.accept(token)
        num_sampled += 1
        if token in tokenizer.eos_token_ids:
            return ids, num_sampled
        ids.append(token)
        for forced in matcher.forced_token_ids():
            assert matcher.accept(forced)
            ids.append(forced)
    raise AssertionError(f"no EOS: {tokenizer.decode(ids)!r}")


@pytest.mark.parametrize("parser", list(SECTION_MARKUPS))
@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_call_parses_back_valid_for_any_delta_size(compiler, tokenizer, parser, choice):
    spec = tool_choice_guidance(TOOLS, NAMED if choice == "named" else "required", True, parser)
    markup = SECTION_MARKUPS[parser]
    for seed in range(4):
        ids, _ = walk(compiler, tokenizer, spec, seed)
        text = tokenizer.decode(ids)
        assert text.startswith(markup.section_begin + markup.call_begin) and text.endswith(
            markup.call_end + markup.section_end)
        results = []
        for tokens_per_delta in (1, 2, 3, 7, len(ids)):
            tool_parser = make_tool_parser(parser, make_call_id=lambda: "call_x")
            events = []
            for at in range(0, len(ids), tokens_per_delta):
                events += tool_parser.feed(tokenizer.decode(ids[at : at + tokens_per_delta]))
            results.append(assemble(events + tool_parser.finish()))
        assert all(result == results[0] for result in results)
        content, [call] = results[0]
        assert content is None
        assert call.name == "get_weather" or (choice == "required" and call.name == "ping")
        arguments = json.loads(call.arguments)
        jsonschema.validate(arguments, LOCATION if call.name == "get_weather" else PING)
        assert call.arguments == json.dumps(arguments, separators=(",", ":"))  # compact
        if parser == "kimi_k2":
            assert call.id.startswith(f"functions.{call.name}:") and call.id.split(":")[1].isdigit()


@pytest.mark.parametrize("parser, head, at_least", [
    # (what the grammar admits before the model chooses again, the part surely forced: the last
    # token of a forced run may be left for the model where a longer token could extend it)
    ("kimi_k2", K_SEC + K_CALL + "functions.get_weather:", K_SEC + K_CALL + "functions.get_weather"),
    ("deepseek_v3", D_SEC + D_CALL + "function" + D_SEP + 'get_weather\n```json\n{"location":"',
     D_SEC + D_CALL + "function" + D_SEP + 'get_weather\n```json\n{"location"'),
    ("deepseek_v31", D_SEC + D_CALL + "get_weather" + D_SEP + '{"location":"',
     D_SEC + D_CALL + "get_weather" + D_SEP + '{"location"'),
])
def test_named_call_markup_is_forced_after_the_first_token(compiler, tokenizer, parser, head,
                                                           at_least):
    matcher = compiler.matcher(tool_choice_guidance(TOOLS, NAMED, True, parser))
    assert matcher.forced_token_ids() == []  # the model picks the first token
    first = tokenizer.backend.token_to_id(SECTION_MARKUPS[parser].section_begin)
    assert matcher.accept(first)
    forced = matcher.forced_token_ids()
    text = tokenizer.decode([first] + forced)
    assert head.startswith(text) and text.startswith(at_least)
    # the markers inside the run are forced as the marker tokens themselves
    assert tokenizer.backend.token_to_id(SECTION_MARKUPS[parser].call_begin) == forced[0]


@pytest.mark.parametrize("parser", list(SECTION_MARKUPS))
def test_arguments_are_compact_and_follow_the_schema(compiler, parser):
    markup = SECTION_MARKUPS[parser]
    head = (markup.section_begin + markup.call_begin + markup.name_prefix + "get_weather"
            + markup.name_suffix + ("0" if markup.numbered else "") + markup.header_end
            + markup.args_prefix)
    matcher = compiler.matcher(tool_choice_guidance(TOOLS, NAMED, True, parser))
    assert matcher.accept_text(head)
    assert not matcher.accept_text('{ "location"')
    assert not matcher.accept_text('{"location": ')
    assert not matcher.accept_text('{"city":')
    assert matcher.accept_text('{"location":"Oslo","days":3}' + markup.args_suffix + markup.call_end
                               + markup.section_end)
    assert matcher.is_complete()


@pytest.mark.parametrize("parser", list(SECTION_MARKUPS))
def test_auto_constrains_calls_once_opened(compiler, parser):
    markup = SECTION_MARKUPS[parser]
    valid = kimi("ping", "{}", 5) if parser == "kimi_k2" else (v3 if parser == "deepseek_v3" else v31)(
        "ping", "{}")
    for parallel in (True, False):
        spec = tool_choice_guidance(TOOLS, "auto", parallel, parser)
        matcher = compiler.matcher(spec)
        assert matcher.accept_text("Free text first. " + markup.section_begin + valid)
        assert matcher.accept_text(valid) == parallel  # a second call only with parallel calls
        assert matcher.accept_text(markup.section_end)
        for opened in (markup.section_begin, ""):  # a call without its section is held too
            matcher = compiler.matcher(spec)
            assert matcher.accept_text("Hi " + opened + markup.call_begin)
            assert not matcher.accept_text(markup.name_prefix + "nope")


# -- rendering calls back -----------------------------------------------------------------------

def test_parsed_calls_render_back_as_the_model_wrote_them():
    """A call the parser read, sent back in history, renders through the format's template as
    the same text: Kimi's ids, DeepSeek's arguments concatenated as text (not an object)."""
    outputs = {
        "kimi_k2": K_SEC + kimi("get_weather", '{"location":"Oslo","days":3}', 7)
        + kimi("ping", "{}", 8) + K_SEC_END,
        "deepseek_v3": D_SEC + v3("get_weather", '{"location":"Oslo","days":3}') + D_SEC_END,
        "deepseek_v31": D_SEC + v31("get_weather", '{"location":"Oslo","days":3}') + D_SEC_END,
    }
    for parser, output in outputs.items():
        tool_parser = make_tool_parser(parser)
        _, calls = assemble(tool_parser.feed(output) + tool_parser.finish())
        messages = [
            ChatMessage.model_validate({"role": "user", "content": "Weather in Oslo?"}),
            ChatMessage.model_validate({"role": "assistant", "content": None, "tool_calls": [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in calls]}),
            ChatMessage.model_validate({"role": "tool", "tool_call_id": calls[0].id, "content": "sunny"}),
        ]
        tokenizer = Tokenizer(HFTokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")),
                              chat_template=chat_template(parser))
        prompt = render_chat_prompt(tokenizer, messages, TOOLS)
        assert f"<|im_start|>assistant\n{output}<|im_end|>\n" in prompt
        assert '"name": "get_weather"' in prompt  # the template listed the tools itself
        if parser == "kimi_k2":
            assert "## Result of functions.get_weather:7\nsunny" in prompt

"""Tool-call parsers: the result never depends on how the output text is split into deltas."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from hearth.server.tool_parsers import (
    Event,
    ToolCallDelta,
    assemble,
    make_tool_parser,
    tool_parser_for_template,
)


def make_ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def split_every(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


def split_random(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    pieces, at = [], 0
    while at < len(text):
        size = rng.randint(1, 9)
        pieces.append(text[at : at + size])
        at += size
    return pieces


def run(parser_name: str, pieces: list[str]) -> list[Event]:
    parser = make_tool_parser(parser_name, make_ids())
    events: list[Event] = []
    for piece in pieces:
        events += parser.feed(piece)
    return events + parser.finish()


def check_stream_shape(events: list[Event]) -> None:
    """Per call: exactly one first delta with id + name, then argument fragments only."""
    seen: set[int] = set()
    for event in events:
        if not isinstance(event, ToolCallDelta):
            continue
        if event.index not in seen:
            assert event.id and event.name and event.arguments == ""
            assert event.index == len(seen)  # indexes appear in order 0, 1, ...
            seen.add(event.index)
        else:
            assert event.id is None and event.name is None and event.arguments


HERMES_CASES = [
    # (output text, expected content, expected [(name, arguments)])
    (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
        None,
        [("get_weather", '{"city": "Paris", "days": 3}')],
    ),
    (
        'Let me check.\n<tool_call>{"name": "a", "arguments": {"x": "}{</tool_call"}}</tool_call>\n'
        '<tool_call>{"arguments": {"y": [1, {"z": "\\"q"}]}, "name": "b"}</tool_call>',
        "Let me check.",
        [("a", '{"x": "}{</tool_call"}'), ("b", '{"y": [1, {"z": "\\"q"}]}')],
    ),
    # A start tag cut off at the end is markup, never content; a lone "<" is content.
    ("Just an answer, no tools. 1 < 2 <tool", "Just an answer, no tools. 1 < 2", []),
    ("1 <", "1 <", []),
    ('<tool_call>{"name": "f"}</tool_call>', None, [("f", "{}")]),
    ('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', None, [("f", '{"a": 1}')]),
    # Malformed calls are dropped: the markup never becomes content.
    ("<tool_call>not json</tool_call> tail", "tail", []),
    # Cut off by max_tokens mid-arguments: the call is reported with what was produced.
    ('<tool_call>{"name": "f", "arguments": {"a": 1', None, [("f", '{"a": 1')]),
    ('<tool_call>\n{"name":"read_file","arguments":{"path":"src/ma', None,
     [("read_file", '{"path":"src/ma')]),
    # ... and before its name is complete: nothing to report, and no markup as content.
    ('Checking.\n<tool_call>\n{"name": "get', "Checking.", []),
    ('<tool_call>\n{"na', None, []),
    ('<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "g',
     None, [("f", "{}")]),
]


@pytest.mark.parametrize("text, content, calls", HERMES_CASES)
@pytest.mark.parametrize("split", ["whole", 1, 2, 7, "random"])
def test_hermes_result_is_independent_of_delta_size(text, content, calls, split):
    if split == "whole":
        pieces = [text]
    elif split == "random":
        pieces = split_random(text, seed=len(text))
    else:
        pieces = split_every(text, split)
    events = run("hermes", pieces)
    check_stream_shape(events)
    got_content, got_calls = assemble(events)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got_calls] == calls
    assert [c.id for c in got_calls] == [f"call_{i}" for i in range(len(calls))]
    for call in got_calls:
        if call.arguments.endswith("}"):
            json.loads(call.arguments)


LLAMA3_CASES = [
    (
        '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
        None,
        [("get_weather", '{"city": "Oslo"}')],
    ),
    (
        '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"k": "v;}"}}',
        None,
        [("a", "{}"), ("b", '{"k": "v;}"}')],
    ),
    ("The answer is {42}.", "The answer is {42}.", []),
    ('{"name": "Bob", "age": 3}', '{"name": "Bob", "age": 3}', []),
    ("  plain text", "  plain text", []),
    # Cut off: with a name and arguments begun it is a call; before its name it is dropped;
    # a JSON object that is no call stays content.
    ('{"name": "get_weather", "parameters": {"city": "Os', None, [("get_weather", '{"city": "Os')]),
    ('{"name": "get_wea', None, []),
    ('{"answer": 4', '{"answer": 4', []),
]


@pytest.mark.parametrize("text, content, calls", LLAMA3_CASES)
@pytest.mark.parametrize("split", ["whole", 1, 2, 7, "random"])
def test_llama3_json_result_is_independent_of_delta_size(text, content, calls, split):
    if split == "whole":
        pieces = [text]
    elif split == "random":
        pieces = split_random(text, seed=7)
    else:
        pieces = split_every(text, split)
    events = run("llama3_json", pieces)
    check_stream_shape(events)
    got_content, got_calls = assemble(events)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got_calls] == calls


def test_header_goes_out_before_arguments_finish():
    """A streaming client sees the name as soon as it is complete, then argument fragments."""
    parser = make_tool_parser("hermes", make_ids())
    assert parser.feed('<tool_call>{"name": "search", "argu') == []
    first = parser.feed('ments": {"q": "ca')
    assert first == [
        ToolCallDelta(0, id="call_0", name="search"),
        ToolCallDelta(0, arguments='{"q": "ca'),
    ]
    assert parser.feed('ts"}}') == [ToolCallDelta(0, arguments='ts"}')]
    assert parser.feed("</tool_call>") == []
    assert parser.finish() == []


def test_content_is_streamed_and_tag_prefix_is_held_back():
    parser = make_tool_parser("hermes", make_ids())
    assert parser.feed("Hi <tool") == ["Hi"]  # " <tool" may still become a tag
    assert parser.feed("box> done") == [" <toolbox> done"]
    assert parser.finish() == []


def test_tool_parser_for_template():
    assert tool_parser_for_template("{{ '<|start_header_id|>' }}") == "llama3_json"
    assert tool_parser_for_template("<|im_start|>") == "hermes"
    assert tool_parser_for_template(None) == "hermes"


def test_unknown_parser_name_is_a_value_error():
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        make_tool_parser("nope")

"""Reasoning parsers (`--reasoning-parser deepseek_r1 | qwen3 | kimi_k2`): the reasoning and content of a
model's output never depend on how the text is split into deltas (every split point, every delta
size), a block cut off or malformed never raises, and a tool call after the reasoning is parsed by
the tool parser while markup inside the reasoning is not a call."""

from __future__ import annotations

import itertools
import json

import pytest

from hearth.api.reasoning import ReasoningDelta
from hearth.server.output_parser import OutputParser, assemble_reasoning, merged
from hearth.server.reasoning_parsers import REASONING_PARSERS, make_reasoning_parser
from hearth.server.tool_parsers import ToolCallDelta, assemble, make_tool_parser
from tests.unit.test_tool_parsers import make_ids, split_random

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'

# (parser, output text, expected reasoning, expected content)
CASES = [
    ("deepseek_r1", "Let me think.\n</think>\n\nThe answer is 4.", "Let me think.\n", "The answer is 4."),
    ("deepseek_r1", "<think>\nhmm</think>4", "\nhmm", "4"),  # R1-0528 writes <think> again
    ("deepseek_r1", "  <think>a < b </thin k></think>x</think>y<think>z",
     "a < b </thin k>", "x</think>y<think>z"),  # stray tags in the answer are content
    ("deepseek_r1", "no end tag: <thi", "no end tag: <thi", None),  # unterminated: all reasoning
    ("deepseek_r1", "</think>", None, None),
    ("deepseek_r1", "</think>answer", None, "answer"),
    ("deepseek_r1", "<thi", "<thi", None),
    ("deepseek_r1", "", None, None),
    ("qwen3", "<think>\nstep 1\n</think>\n\nDone.", "\nstep 1\n", "Done."),
    ("qwen3", "\n<think>a</think> b", "a", "b"),
    ("qwen3", "Plain answer, no thinking.", None, "Plain answer, no thinking."),
    ("qwen3", "<thinking is not a tag", None, "<thinking is not a tag"),
    ("qwen3", "a</think>b", None, "a</think>b"),  # no block opened: all content
    ("qwen3", "<think>cut off by max_toke", "cut off by max_toke", None),
    ("qwen3", "<think></think>", None, None),
    ("qwen3", "<think></think>\n\n", None, None),
    ("qwen3", "<th", None, "<th"),
    ("qwen3", "  ", None, "  "),
    ("qwen3", "", None, None),
    ("kimi_k2", "Let me think.</think>\n\nThe answer is 4.", "Let me think.", "The answer is 4."),
    ("kimi_k2", "no end tag", "no end tag", None),
    # a tool-call section ends the reasoning without </think>, and stays for the tool parser
    ("kimi_k2", "Weather first.<|tool_calls_section_begin|>x", "Weather first.",
     "<|tool_calls_section_begin|>x"),
    ("kimi_k2", "<|tool_calls_section_begi", "<|tool_calls_section_begi", None),
]


def run(name: str, pieces: list[str], tools: str | None = None) -> list:
    parser = OutputParser(make_reasoning_parser(name),
                          make_tool_parser(tools, make_ids()) if tools else None)
    events = []
    for piece in pieces:
        new = parser.feed(piece)
        assert all(not isinstance(e, ReasoningDelta) or e.text for e in new)
        assert all(not isinstance(e, str) or e for e in new)  # no empty events
        events += new
    return events + parser.finish()


def folded(events: list) -> tuple[str | None, str | None]:
    reasoning = assemble_reasoning(events)
    content = "".join(e for e in events if isinstance(e, str)) or None
    return reasoning, content


def answer(events: list) -> tuple:
    """(reasoning, content, calls) as a non-streamed response carries them."""
    return (assemble_reasoning(events),
            *assemble([e for e in events if not isinstance(e, ReasoningDelta)]))


def splits(text: str):
    """Every way of cutting `text` in two, every fixed delta size, and random cuts."""
    for cut in range(len(text) + 1):
        yield [text[:cut], text[cut:]]
    for size in range(1, len(text) + 1):
        yield [text[i:i + size] for i in range(0, len(text), size)]
    for seed in range(5):
        yield split_random(text, seed)


@pytest.mark.parametrize("name,text,reasoning,content", CASES)
def test_result_is_independent_of_the_split(name, text, reasoning, content):
    whole = run(name, [text])
    assert folded(whole) == (reasoning, content)
    for pieces in splits(text):
        events = run(name, pieces)
        assert folded(events) == (reasoning, content), pieces
        assert merged(events) == merged(whole), pieces  # the same order of kinds, too


def test_every_pair_of_cut_points():
    text = "<think>a</think>\n\nb</think>c"
    for i, j in itertools.combinations(range(len(text) + 1), 2):
        for name in REASONING_PARSERS:
            assert merged(run(name, [text[:i], text[i:j], text[j:]])) == merged(run(name, [text]))


def test_reasoning_streams_before_the_block_ends_and_holds_only_a_tag_prefix():
    parser = make_reasoning_parser("deepseek_r1")
    assert parser.feed("I wonder") == [ReasoningDelta("I wonder")]
    assert parser.feed(" if </th") == [ReasoningDelta(" if ")]
    assert parser.feed("ink>\n") == []  # the tag is markup; the space after it is held
    assert parser.feed("\nYes") == ["Yes"]
    assert parser.finish() == []
    parser = make_reasoning_parser("qwen3")
    assert parser.feed(" <thi") == []  # may still open a block
    assert parser.feed("nk>x") == [ReasoningDelta("x")]


def test_reasoning_end_counts_the_markup():
    for name, text, end in [("deepseek_r1", "ab</think>\ncd", 10), ("deepseek_r1", "abc", 3),
                            ("qwen3", "<think>ab</think>cd", 17), ("qwen3", "cd", 0),
                            ("qwen3", "<think>ab", 9)]:
        parser = make_reasoning_parser(name)
        parser.feed(text)
        parser.finish()
        assert parser.reasoning_end == end, (name, text)
    parser = make_reasoning_parser("deepseek_r1")
    parser.feed("ab")
    assert parser.reasoning_end is None and parser.in_reasoning


@pytest.mark.parametrize("name,prefix", [("deepseek_r1", "Check the weather.</think>\n"),
                                         ("qwen3", "<think>Check the weather.</think>\n")])
def test_a_tool_call_after_the_reasoning_is_a_call(name, prefix):
    text = prefix + "Sure. " + CALL
    whole = run(name, [text], tools="hermes")
    for pieces in splits(text):  # call deltas are cut where the text was: compare the results
        events = run(name, pieces, tools="hermes")
        assert answer(events) == answer(whole), pieces
    assert assemble_reasoning(whole) == "Check the weather."
    content, calls = assemble([e for e in whole if not isinstance(e, ReasoningDelta)])
    assert content == "Sure."
    [call] = calls
    assert (call.name, call.arguments) == ("get_weather", '{"city": "Paris"}')
    kinds = [type(e) for e in merged(whole)]
    assert kinds[0] is ReasoningDelta and ToolCallDelta in kinds


def test_a_kimi_tool_section_ends_the_reasoning_and_is_a_call():
    """Kimi K2 Thinking may open its tool-call section straight from the reasoning (no
    </think>): the reasoning ends there and the section is parsed as calls, at every split."""
    from tests.unit.test_tool_parsers_kimi_deepseek import K_SEC, K_SEC_END, kimi
    text = "Check the weather." + K_SEC + kimi("get_weather", '{"city": "Paris"}') + K_SEC_END
    whole = run("kimi_k2", [text], tools="kimi_k2")
    for pieces in splits(text):
        assert answer(run("kimi_k2", pieces, tools="kimi_k2")) == answer(whole), pieces
    assert assemble_reasoning(whole) == "Check the weather."
    content, calls = assemble([e for e in whole if not isinstance(e, ReasoningDelta)])
    assert not content
    [call] = calls
    assert (call.name, call.arguments) == ("get_weather", '{"city": "Paris"}')


def test_a_call_inside_the_reasoning_is_reasoning():
    text = "maybe " + CALL + "</think>No call."
    events = run("deepseek_r1", [text], tools="hermes")
    assert assemble_reasoning(events) == "maybe " + CALL
    assert assemble([e for e in events if not isinstance(e, ReasoningDelta)]) == ("No call.", [])


def test_unknown_name_is_a_value_error():
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        make_reasoning_parser("granite")


def writer_events(writer) -> list[dict]:
    """The payloads of every SSE event a writer sends for reasoning, content, a call, the end."""
    from hearth.api.chat_chunks import Usage
    from hearth.api.chat_output import Finished

    chunks = writer.start()
    for event in [ReasoningDelta("Think "), ReasoningDelta("hard."), "Sure.",
                  ToolCallDelta(0, id="call_1", name="f"), ToolCallDelta(0, arguments='{"a": 1}'),
                  Finished("tool_calls", Usage(5, 9, reasoning_tokens=4))]:
        chunks += writer.feed(event)
    return [json.loads(chunk.split("data: ", 1)[1]) for chunk in chunks]


def test_responses_writer_writes_a_reasoning_item_the_sdk_reads():
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    from hearth.api.responses_writer import ResponseWriter

    writer = ResponseWriter("resp_1", "m", 0, {"tools": [], "tool_choice": "auto",
                                                "parallel_tool_calls": True})
    payloads = writer_events(writer)
    events = [TypeAdapter(ResponseStreamEvent).validate_python(p) for p in payloads]
    body = Response.model_validate(writer.body())
    assert [item.type for item in body.output] == ["reasoning", "message", "function_call"]
    assert body.output[0].content[0].text == "Think hard." and body.output[0].summary == []
    assert body.output_text == "Sure."
    assert body.usage.output_tokens_details.reasoning_tokens == 4
    kinds = [e.type for e in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == \
        "Think hard."


def test_messages_writer_writes_a_thinking_block_the_sdk_reads():
    from anthropic.types import Message, RawMessageStreamEvent
    from pydantic import TypeAdapter

    from hearth.api.messages_writer import MessageWriter

    writer = MessageWriter("msg_1", "m")
    events = [TypeAdapter(RawMessageStreamEvent).validate_python(p)
              for p in writer_events(writer) if p["type"] != "ping"]
    message = Message.model_validate(writer.body())
    assert [b.type for b in message.content] == ["thinking", "text", "tool_use"]
    assert message.content[0].thinking == "Think hard." and message.content[0].signature == ""
    assert message.content[2].input == {"a": 1}
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use"]


def test_reasoning_input_goes_to_the_assistant_turn():
    from hearth.api.messages_api import MessagesRequest, to_chat_body as messages_body
    from hearth.api.responses_api import items_to_messages

    messages = items_to_messages([
        {"type": "message", "role": "user", "content": "q"},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "because"}]},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c", "output": "1"},
        {"type": "reasoning", "id": "rs_2", "summary": [{"type": "summary_text", "text": "s"}]},
        {"type": "message", "role": "user", "content": "again"}])
    assert [(m["role"], m.get("reasoning_content")) for m in messages] == [
        ("user", None), ("assistant", "because"), ("tool", None), ("assistant", "s"),
        ("user", None)]
    request = MessagesRequest.model_validate({"model": "m", "max_tokens": 4, "messages": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "t", "signature": "x"},
                                          {"type": "redacted_thinking", "data": "..."},
                                          {"type": "text", "text": "a"}]}]})
    assert messages_body(request)["messages"][1] == {"role": "assistant", "content": "a",
                                                    "reasoning_content": "t"}

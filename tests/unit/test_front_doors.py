"""The Responses and Messages front doors' pure parts: requests -> the internal chat request, the
internal output stream -> each API's events and bodies (checked against the official SDKs' own
types), the chat-chunk reader the router uses, the response store, and Anthropic error bodies."""

from __future__ import annotations

import json
from functools import cache

import pytest
from pydantic import TypeAdapter

from hearth.api.chat_output import ChatChunkReader, Failed, Finished
from hearth.api.messages_api import (CountTokensRequest, MessagesRequest, anthropic_error_body,
                                        to_chat_body as messages_chat_body, to_tokenize_body)
from hearth.api.messages_writer import MessageWriter
from hearth.api.protocol import APIError, ChatCompletionRequest, parse_request
from hearth.api.chat_chunks import ChunkMaker, Usage
from hearth.api.responses_api import (ResponsesRequest, ResponseStore, StoredResponse,
                                         request_echo, to_chat_body as responses_chat_body)
from hearth.api.responses_writer import ResponseWriter
from hearth.api.tool_calls import ToolCallDelta


# The SDKs' types, imported when a test first needs them (anthropic's import alone is ~1.3 s;
# under `make test`'s two workers it is paid only by the worker that runs these tests).
@cache
def openai_response():
    from openai.types.responses import Response

    return Response


@cache
def openai_event() -> TypeAdapter:
    from openai.types.responses import ResponseStreamEvent

    return TypeAdapter(ResponseStreamEvent)


@cache
def anthropic_message():
    from anthropic.types import Message

    return Message


@cache
def anthropic_event() -> TypeAdapter:
    from anthropic.types import RawMessageStreamEvent

    return TypeAdapter(RawMessageStreamEvent)


USAGE = Usage(prompt_tokens=40, completion_tokens=9, cached_tokens=32)
TEXT_THEN_CALL = ["I will ", "check.", ToolCallDelta(0, id="call_a", name="get_weather"),
                  ToolCallDelta(0, arguments='{"city": '), ToolCallDelta(0, arguments='"Paris"}'),
                  Finished("tool_calls", USAGE)]


def sse_payloads(chunks: list[str]) -> list[tuple[str, dict]]:
    """(event name, data) of each `event:` + `data:` SSE chunk."""
    out = []
    for chunk in chunks:
        event_line, data_line = chunk.strip().split("\n")
        assert event_line.startswith("event: ") and data_line.startswith("data: ")
        out.append((event_line[7:], json.loads(data_line[6:])))
    return out


def responses_request(**fields) -> ResponsesRequest:
    return parse_request(ResponsesRequest, {"model": "m", **fields})


# ---- Responses: request -> chat ----------------------------------------------------------------


def test_responses_items_become_chat_messages_with_calls_merged_into_one_turn():
    request = responses_request(instructions="Be brief.", input=[
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sure."}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": '{"x": 1}'},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "two"}]},
    ], tools=[{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        tool_choice={"type": "function", "name": "f"}, max_output_tokens=7, top_p=0.5,
        text={"format": {"type": "json_schema", "name": "out", "schema": {"type": "object"}}})
    body = responses_chat_body(request, [])
    assert body["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Sure.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
    ]
    assert body["tools"] == [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert body["response_format"]["json_schema"]["schema"] == {"type": "object"}
    assert body["max_completion_tokens"] == 7 and body["top_p"] == 0.5
    parse_request(ChatCompletionRequest, body)  # a valid internal request


def test_history_comes_first_and_instructions_are_not_carried_over():
    history = [{"type": "message", "role": "user", "content": "Hi"},
               {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
                "content": [{"type": "output_text", "text": "Hello", "annotations": []}]}]
    body = responses_chat_body(responses_request(input="And you?", instructions="New rules."), history)
    assert body["messages"] == [{"role": "system", "content": "New rules."},
                                {"role": "user", "content": "Hi"},
                                {"role": "assistant", "content": "Hello"},
                                {"role": "user", "content": "And you?"}]


@pytest.mark.parametrize("item, param", [
    ({"type": "input_image"}, "input.0.type"),
    ({"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}, "input.0.content.0.type"),
    ({"role": "robot", "content": "x"}, "input.0.role"),
    ({"type": "function_call_output", "output": "x"}, "input.0.call_id"),
    ("just a string", "input.0"),
])
def test_unsupported_items_are_400s_naming_the_item(item, param):
    with pytest.raises(APIError) as info:
        responses_chat_body(responses_request(input=[item]), [])
    assert info.value.status == 400 and info.value.param == param


# ---- Responses: events -> stream and body ------------------------------------------------------


def write_response(events, echo=None) -> tuple[ResponseWriter, list[tuple[str, dict]]]:
    writer = ResponseWriter("resp_1", "m", 1700000000, echo or request_echo(responses_request(input="x")))
    chunks = writer.start()
    for event in events:
        chunks += writer.feed(event)
    return writer, sse_payloads(chunks)


def test_response_stream_follows_the_documented_sequence_and_sdk_types():
    writer, events = write_response(TEXT_THEN_CALL)
    assert [name for name, _ in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    for name, data in events:
        assert data["type"] == name
        openai_event().validate_python(data)
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    body = openai_response().model_validate(writer.body())
    assert body.status == "completed" and body.output_text == "I will check."
    message, call = body.output
    assert call.type == "function_call" and call.call_id == "call_a"
    assert call.arguments == '{"city": "Paris"}' and call.status == "completed"
    assert events[-1][1]["response"] == writer.body()
    assert body.usage.input_tokens == 40 and body.usage.input_tokens_details.cached_tokens == 32
    assert body.usage.output_tokens == 9 and body.usage.total_tokens == 49


def test_response_text_does_not_depend_on_how_it_was_split():
    whole, _ = write_response(["Hello world", Finished("stop", USAGE)])
    split, events = write_response(["Hel", "lo", " world", Finished("stop", USAGE)])
    assert openai_response().model_validate(split.body()).output_text == "Hello world"
    assert whole.body()["output"][0]["content"] == split.body()["output"][0]["content"]
    assert "".join(d["delta"] for n, d in events if n == "response.output_text.delta") == "Hello world"


def test_length_stop_is_an_incomplete_response_and_failure_a_failed_one():
    writer, events = write_response(["Once upon", Finished("length", USAGE)])
    assert events[-1][0] == "response.incomplete"
    assert writer.body()["incomplete_details"] == {"reason": "max_output_tokens"}
    assert writer.body()["output"][0]["status"] == "incomplete"
    writer, events = write_response(["Once", Failed("engine died")])
    assert events[-1][0] == "response.failed"
    assert openai_response().model_validate(writer.body()).error.message == "engine died"


def test_an_empty_answer_is_an_empty_message():
    writer, events = write_response([Finished("stop", USAGE)])
    assert openai_response().model_validate(writer.body()).output_text == ""
    assert [n for n, _ in events][2:4] == ["response.output_item.added", "response.content_part.added"]


def test_response_store_is_a_bounded_lru_and_unknown_ids_are_openai_404s():
    store = ResponseStore(capacity=2)
    for name in ("a", "b"):
        store.put(name, StoredResponse({"id": name}, []))
    store.get("a")  # now the most recently used
    store.put("c", StoredResponse({"id": "c"}, []))
    assert len(store) == 2 and store.get("a").body == {"id": "a"}
    with pytest.raises(APIError) as info:
        store.get("b", "previous_response_id")
    assert info.value.status == 404 and info.value.code == "previous_response_not_found"
    assert info.value.body()["error"]["param"] == "previous_response_id"


# ---- Messages: request -> chat ------------------------------------------------------------------


def messages_request(**fields) -> MessagesRequest:
    return parse_request(MessagesRequest, {"model": "m", "max_tokens": 50, **fields})


def test_messages_blocks_become_chat_messages():
    request = messages_request(system=[{"type": "text", "text": "Be brief."}], messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": "timeout", "is_error": True},
            {"type": "text", "text": "Thanks"}]},
    ], tools=[{"name": "get_weather", "description": "d", "input_schema": {"type": "object"}}],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        stop_sequences=["\n\n"], top_k=5, metadata={"user_id": "u1"})
    body = messages_chat_body(request)
    assert body["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: timeout"},
        {"role": "user", "content": "Thanks"},
    ]
    assert body["tools"][0]["function"]["parameters"] == {"type": "object"}
    assert body["tool_choice"] == "required" and body["parallel_tool_calls"] is False
    assert body["stop"] == ["\n\n"] and body["top_k"] == 5 and body["max_completion_tokens"] == 50
    assert body["user"] == "u1"
    parse_request(ChatCompletionRequest, body)


@pytest.mark.parametrize("choice, expected", [
    ({"type": "auto"}, "auto"), ({"type": "none"}, "none"),
    ({"type": "tool", "name": "f"}, {"type": "function", "function": {"name": "f"}}),
])
def test_messages_tool_choice(choice, expected):
    request = messages_request(messages=[{"role": "user", "content": "x"}], tool_choice=choice,
                               tools=[{"name": "f", "input_schema": {"type": "object"}}])
    assert messages_chat_body(request)["tool_choice"] == expected


@pytest.mark.parametrize("choice, tools, message", [
    ({"type": "tool", "name": "g"}, [{"name": "f", "input_schema": {"type": "object"}}],
     "tool_choice names function 'g', which is not in tools"),
    ({"type": "any"}, None, "tool_choice requires tools"),
    ({"type": "tool", "name": "f"}, None, "tool_choice requires tools"),
])
def test_messages_and_count_tokens_refuse_the_same_tool_choices(choice, tools, message):
    fields = {"model": "m", "messages": [{"role": "user", "content": "x"}], "tool_choice": choice,
              **({"tools": tools} if tools else {})}
    with pytest.raises(APIError, match=message) as refused:
        messages_chat_body(messages_request(**{k: v for k, v in fields.items() if k != "model"}))
    assert refused.value.status == 400
    with pytest.raises(APIError, match=message):
        to_tokenize_body(parse_request(CountTokensRequest, fields))


def test_count_tokens_body_leaves_tools_out_under_tool_choice_none():
    fields = {"model": "m", "messages": [{"role": "user", "content": "x"}],
              "tools": [{"name": "f", "input_schema": {"type": "object"}}]}
    assert "tools" in to_tokenize_body(parse_request(CountTokensRequest, fields))
    fields["tool_choice"] = {"type": "none"}
    assert "tools" not in to_tokenize_body(parse_request(CountTokensRequest, fields))


def test_structured_outputs_pass_through_both_front_doors():
    """vLLM's extension, as the Chat API takes it; a bad one is the Chat API's 400 there."""
    spec = {"regex": "[a-z]+"}
    body = messages_chat_body(messages_request(messages=[{"role": "user", "content": "x"}],
                                               structured_outputs=spec))
    assert body["structured_outputs"] == spec
    assert parse_request(ChatCompletionRequest, body).structured_outputs.regex == "[a-z]+"
    body = responses_chat_body(responses_request(input="x", structured_outputs=spec), [])
    assert body["structured_outputs"] == spec
    assert "structured_outputs" not in responses_chat_body(responses_request(input="x"), [])
    with pytest.raises(APIError) as info:
        messages_request(messages=[{"role": "user", "content": "x"}], structured_outputs={"regex": 1})
    assert info.value.param.startswith("structured_outputs")


@pytest.mark.parametrize("fields, param", [
    ({"max_tokens": None}, "max_tokens"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages.0.content.0.type"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "x"}]}]},
     "messages.0.content.0.type"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x",
                                                  "content": [{"type": "image"}]}]}]},
     "messages.0.content.0.content.0.type"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                                       "input": "no"}]}]},
     "messages.0.content.0.input"),
    ({"tool_choice": {"type": "tool"}}, "tool_choice.name"),
])
def test_bad_messages_are_400s_naming_the_field(fields, param):
    raw = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}], **fields}
    raw = {k: v for k, v in raw.items() if v is not None}
    with pytest.raises(APIError) as info:
        messages_chat_body(parse_request(MessagesRequest, raw))
    assert info.value.status == 400 and info.value.param == param


@pytest.mark.parametrize("status, kind", [(400, "invalid_request_error"), (401, "authentication_error"),
                                          (404, "not_found_error"), (413, "request_too_large"),
                                          (429, "rate_limit_error"), (500, "api_error"),
                                          (503, "overloaded_error")])
def test_anthropic_error_bodies(status, kind):
    body = anthropic_error_body(status, APIError(status, "nope").body())
    assert body == {"type": "error", "error": {"type": kind, "message": "nope"}}


# ---- Messages: events -> stream and body -------------------------------------------------------


def write_message(events) -> tuple[MessageWriter, list[tuple[str, dict]]]:
    writer = MessageWriter("msg_1", "m")
    chunks = writer.start()
    for event in events:
        chunks += writer.feed(event)
    return writer, sse_payloads(chunks)


def test_message_stream_events_and_body_match_the_sdk_types():
    writer, events = write_message(TEXT_THEN_CALL)
    assert [name for name, _ in events] == [
        "message_start", "ping", "content_block_start", "content_block_delta", "content_block_delta",
        "content_block_stop", "content_block_start", "content_block_delta", "content_block_delta",
        "content_block_stop", "message_delta", "message_stop"]
    for name, data in events:
        assert data["type"] == name
        if name != "ping":
            anthropic_event().validate_python(data)
    message = anthropic_message().model_validate(writer.body())
    text, call = message.content
    assert text.text == "I will check." and call.type == "tool_use" and call.input == {"city": "Paris"}
    assert message.stop_reason == "tool_use"
    assert message.usage.input_tokens == 8 and message.usage.cache_read_input_tokens == 32
    assert message.usage.output_tokens == 9
    partial = "".join(d["delta"].get("partial_json", "") for n, d in events if n == "content_block_delta")
    assert json.loads(partial) == {"city": "Paris"}
    assert events[-2][1]["usage"] == writer.body()["usage"]


@pytest.mark.parametrize("finished, reason, sequence", [
    (Finished("stop", USAGE), "end_turn", None),
    (Finished("stop", USAGE, stop_sequence="END"), "stop_sequence", "END"),
    (Finished("length", USAGE), "max_tokens", None),
])
def test_message_stop_reasons(finished, reason, sequence):
    writer, events = write_message(["Hi", finished])
    assert events[-2][1]["delta"] == {"stop_reason": reason, "stop_sequence": sequence}
    assert writer.body()["stop_reason"] == reason and writer.body()["stop_sequence"] == sequence


def test_a_failure_after_the_start_is_an_error_event():
    _, events = write_message(["Hi", Failed("engine died")])
    assert events[-1] == ("error", {"type": "error", "error": {"type": "api_error", "message": "engine died"}})


# ---- the router's reader: chat chunks -> the same events ---------------------------------------


def test_chat_chunks_read_back_into_the_events_that_made_them():
    maker = ChunkMaker("chatcmpl-1", 1, "m", chat=True, include_usage=True)
    payloads = [maker.chat(0, {"role": "assistant", "content": ""}), maker.chat(0, {"content": "I will "}),
                maker.chat(0, {"content": "check."}),
                maker.chat(0, {"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                                               "function": {"name": "get_weather", "arguments": ""}}]}),
                maker.chat(0, {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}),
                maker.chat(0, {"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}),
                maker.chat(0, {}, None, "tool_calls"), maker.usage(USAGE)]
    reader = ChatChunkReader()
    events = [e for p in payloads for e in reader.feed(json.loads(p[6:]))] + reader.done()
    assert events == TEXT_THEN_CALL


def test_reader_reports_stop_strings_errors_and_cut_streams():
    maker = ChunkMaker("chatcmpl-1", 1, "m", chat=True, include_usage=True)
    reader = ChatChunkReader()
    reader.feed(json.loads(maker.chat(0, {}, None, "stop", "END")[6:]))
    assert reader.done() == [Finished("stop", Usage(), "END")]
    reader = ChatChunkReader()
    assert reader.feed({"error": {"message": "decode failed"}}) == [Failed("decode failed")]
    assert reader.done() == []
    reader = ChatChunkReader()
    reader.feed(json.loads(maker.chat(0, {"content": "Hi"})[6:]))
    assert isinstance(reader.done()[0], Failed)

"""Kimi K2 and DeepSeek V3 / V3.1 tool calls served for real: the default model with the format's
markers in its tokenizer and a template that writes the format (tests/e2e/marker_model.py), under
`--tool-call-parser auto`. A forced call comes back parsed and schema-valid through the official
clients of all three APIs, streamed the same as not, and goes back into history through the
template. The markers are special tokens, so this also proves the server keeps them in the text
its parser reads (and out of content)."""

from __future__ import annotations

import json
import re

import anthropic
import httpx
import jsonschema
import pytest

from tests.e2e.conftest import MODEL, start_server
from tests.e2e.marker_model import FIRST_MARKER_ID, write_marker_model
from tests.e2e.test_tools import ASK, SCHEMAS, TOOLS, WEATHER, assemble_stream
from tests.tool_markup import MARKERS

GREEDY = dict(model=MODEL, temperature=0)


@pytest.fixture(scope="module", params=["kimi_k2", "deepseek_v3", "deepseek_v31"])
def marker_server(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    model = write_marker_model(folder / f"smollm2-{request.param}.gguf", request.param)
    server = start_server(folder, "--model", str(model), "--served-model-name", MODEL,
                          "--tool-call-parser", "auto", "--num-kv-blocks", "256")
    yield request.param, server
    report = server.wait_idle_and_whole()
    server.stop()
    assert report["kv_pool_is_whole"] is True, report


def check_call_id(parser: str, call_id: str, name: str) -> None:
    if parser == "kimi_k2":  # the header the model wrote: functions.NAME:INDEX
        assert re.fullmatch(rf"functions\.{name}:\d+", call_id), call_id
    else:
        assert call_id.startswith("call_")


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_call_through_chat_completions(marker_server, tool_choice):
    parser, server = marker_server
    client = server.client()
    kwargs = dict(messages=ASK, tools=TOOLS, tool_choice=tool_choice, max_tokens=120, **GREEDY)
    response = client.chat.completions.create(**kwargs)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name in SCHEMAS
    if isinstance(tool_choice, dict):
        assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    check_call_id(parser, call.id, call.function.name)

    content, streamed, reason = assemble_stream(client.chat.completions.create(**kwargs, stream=True))
    assert reason == "tool_calls" and content == "" and list(streamed) == [0]
    # greedy: the same call both ways (a Kimi id is the model's text too; DeepSeek's are random)
    assert (streamed[0]["name"], streamed[0]["arguments"]) == (call.function.name, call.function.arguments)
    check_call_id(parser, streamed[0]["id"], call.function.name)
    if parser == "kimi_k2":
        assert streamed[0]["id"] == call.id

    # Sent back with its result, the call renders through the template as the model's markup.
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "sunny, 24C"}'}]
    tokenized = httpx.post(server.url + "/tokenize", json={"model": MODEL, "messages": history,
                                                           "tools": TOOLS}, timeout=60).json()
    marker_ids = range(FIRST_MARKER_ID, FIRST_MARKER_ID + len(MARKERS[parser]))
    # section begin / end, call begin / end (and Kimi's argument marker / DeepSeek's separator)
    assert sorted(set(tokenized["tokens"]) & set(marker_ids)) == list(marker_ids)
    follow = client.chat.completions.create(messages=history, tools=TOOLS, max_tokens=16, **GREEDY)
    assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_forced_call_through_responses(marker_server):
    parser, server = marker_server
    response = server.client().responses.create(
        input=ASK, tools=[{"type": "function", **t["function"]} for t in TOOLS],
        tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=120, **GREEDY)
    [call] = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    check_call_id(parser, call.call_id, call.name)


def test_forced_call_through_messages(marker_server):
    parser, server = marker_server
    client = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=120)
    message = client.messages.create(
        model=MODEL, max_tokens=120, messages=ASK, tool_choice={"type": "any"},
        tools=[{"name": t["function"]["name"], "description": t["function"]["description"],
                "input_schema": t["function"]["parameters"]} for t in TOOLS],
        extra_body={"temperature": 0})
    assert message.stop_reason == "tool_use"
    [block] = message.content
    assert block.type == "tool_use" and block.name in SCHEMAS
    jsonschema.validate(block.input, SCHEMAS[block.name])
    check_call_id(parser, block.id, block.name)

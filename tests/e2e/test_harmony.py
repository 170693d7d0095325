"""The harmony format served for real: the default model with harmony's special tokens added to
its tokenizer and a chat template that writes harmony channels (tests/e2e/marker_model.py), so
`--chat-format auto` picks hearth's harmony renderer and `--tool-call-parser auto` the openai
parser, with the openai_gptoss reasoning parser by default. The model's output is forced by a
regex (`structured_outputs`) into an analysis message and a tool call: through the official
client the reasoning comes back as reasoning_content, the call as a tool call, streamed the same
as not; a forced call (tool_choice) through the Responses and Messages APIs."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

from tests.e2e.conftest import MODEL
from tests.e2e.harmony_model import (FORCED, HARMONY_TOKENS, TEMPLATE, forced,
                                      start_harmony_server, stop_whole)
from tests.e2e.marker_model import FIRST_MARKER_ID, write_model_copy
from tests.e2e.test_tools import ASK, SCHEMAS, TOOLS, assemble_stream

GREEDY = dict(model=MODEL, temperature=0)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("harmony")
    server = start_harmony_server(
        folder, write_model_copy(folder / "smollm2-harmony.gguf", HARMONY_TOKENS, TEMPLATE))
    yield server
    stop_whole(server)


def test_prompt_is_harmony(server):
    tokens = httpx.post(server.url + "/tokenize", json={"model": MODEL, "messages": ASK,
                                                        "tools": TOOLS}, timeout=60).json()["tokens"]
    ids = {token: FIRST_MARKER_ID + i for i, token in enumerate(HARMONY_TOKENS)}
    # each harmony token is one special token: system, developer, user, then the generation prompt
    assert tokens[0] == ids["<|start|>"] and tokens.count(ids["<|start|>"]) == 4
    assert tokens.count(ids["<|end|>"]) == 3 and ids["<|channel|>"] not in tokens


def test_reasoning_and_tool_call_streamed_and_not(server):
    client = server.client()
    kwargs = dict(messages=ASK, tools=TOOLS, max_tokens=120, reasoning_effort="low",
                  extra_body=forced(FORCED), **GREEDY)
    response = client.chat.completions.create(**kwargs)
    choice = response.choices[0]
    reasoning = choice.message.reasoning_content
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert reasoning and "<|" not in reasoning and 3 <= len(reasoning) <= 24
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert list(json.loads(call.function.arguments)) == ["city"]
    details = response.usage.completion_tokens_details
    assert 0 < details.reasoning_tokens < response.usage.completion_tokens

    stream = client.chat.completions.create(**kwargs, stream=True)
    chunks = list(stream)
    streamed_reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or ""
                                 for c in chunks if c.choices)
    content, calls, reason = assemble_stream(iter(chunks))
    assert streamed_reasoning == reasoning and content == "" and reason == "tool_calls"
    assert (calls[0]["name"], calls[0]["arguments"]) == ("get_weather", call.function.arguments)


def test_responses_forced_call_with_effort(server):
    response = server.client().responses.create(
        model=MODEL, input=ASK[0]["content"], temperature=0, max_output_tokens=120,
        reasoning={"effort": "high"}, tool_choice="required",
        tools=[{"type": "function", "name": t["function"]["name"],
                "parameters": t["function"]["parameters"]} for t in TOOLS])
    assert response.reasoning.effort == "high"
    [item] = response.output
    assert item.type == "function_call" and item.name in SCHEMAS
    json.loads(item.arguments)


def test_bad_effort_is_a_400(server):
    reply = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": ASK, "reasoning_effort": "max"})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "reasoning_effort"


def test_messages_api_forced_call(server):
    client = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=120)
    message = client.messages.create(
        model=MODEL, max_tokens=120, messages=ASK, tool_choice={"type": "tool", "name": "get_weather"},
        system="Be brief.",
        tools=[{"name": t["function"]["name"], "description": t["function"]["description"],
                "input_schema": t["function"]["parameters"]} for t in TOOLS],
        extra_body={"temperature": 0})
    assert message.stop_reason == "tool_use"
    [block] = message.content
    assert block.type == "tool_use" and block.name == "get_weather"
    jsonschema.validate(block.input, SCHEMAS["get_weather"])


@pytest.mark.parametrize("body", [
    {"structured_outputs": {"regex": "a", "grammar": "root ::= \"a\""}},
    {"structured_outputs": {}},
    {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
])
def test_bad_structured_outputs_are_400s(server, body):
    reply = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                       json={"model": MODEL, "messages": ASK, **body})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "structured_outputs"

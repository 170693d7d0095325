"""The Anthropic Messages API with the official `anthropic` client, against a real worker and
through the router in front of it: create, stream, a tool round trip, count_tokens, stop
sequences, Anthropic-shaped errors and `x-api-key` auth. The worker's pool is whole after each."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

from tests.e2e.conftest import MODEL
from tests.e2e.test_tools import SCHEMAS, WEATHER

TOOLS = [{"name": "get_weather", "description": "Weather forecast for a city", "input_schema": WEATHER}]
ASK = [{"role": "user", "content": "What will the weather be in Paris for the next 3 days?"}]
# the SDK no longer has sampling arguments; the API (and hearth) still take them in the body
GREEDY = dict(model=MODEL, extra_body={"temperature": 0})


@pytest.fixture(params=["worker", "router"])
def api(request, server, edge_router):
    yield server if request.param == "worker" else edge_router
    report = server.wait_idle_and_whole()
    assert report["num_requests_inflight"] == 0 and report["kv_pool_is_whole"] is True, report


def client_for(api, api_key: str | None = None) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=api.url, api_key=api_key or api.api_key or "none",
                               max_retries=0, timeout=120)


def test_create_returns_a_text_message_with_usage(api):
    message = client_for(api).messages.create(
        max_tokens=12, system="You are terse.", messages=[{"role": "user", "content": "Name a fruit."}],
        **GREEDY)
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    [block] = message.content
    assert block.type == "text" and block.text
    assert message.stop_reason in ("end_turn", "max_tokens") and message.stop_sequence is None
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens > 10 and 0 < usage.output_tokens <= 12


def test_stream_gives_the_same_message_as_create(api):
    client = client_for(api)
    fields = dict(max_tokens=10, messages=[{"role": "user", "content": "Name a color."}], **GREEDY)
    plain = client.messages.create(**fields)
    with client.messages.stream(**fields) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == plain.content[0].text
    assert final.stop_reason == plain.stop_reason
    assert final.usage.output_tokens == plain.usage.output_tokens
    assert (final.usage.input_tokens + final.usage.cache_read_input_tokens
            == plain.usage.input_tokens + plain.usage.cache_read_input_tokens)


def test_raw_stream_event_order(api):
    with client_for(api).messages.create(max_tokens=5, stream=True,
                                         messages=[{"role": "user", "content": "Hi"}], **GREEDY) as events:
        types = [event.type for event in events]
    assert types[:2] == ["message_start", "content_block_start"]
    assert types[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(types[2:-3]) == {"content_block_delta"}


def test_tool_round_trip_with_tool_use_and_tool_result(api):
    client = client_for(api)
    first = client.messages.create(max_tokens=80, messages=ASK, tools=TOOLS,
                                   tool_choice={"type": "any"}, **GREEDY)
    assert first.stop_reason == "tool_use"
    [call] = [block for block in first.content if block.type == "tool_use"]
    assert call.name == "get_weather" and call.id
    jsonschema.validate(call.input, SCHEMAS["get_weather"])
    history = ASK + [
        {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                      "content": [{"type": "text", "text": "Sunny, 21 C."}]}]}]
    second = client.messages.create(max_tokens=20, messages=history, tools=TOOLS, **GREEDY)
    assert second.content and second.stop_reason in ("end_turn", "max_tokens", "tool_use")
    # the first turn is a prefix of the second: its prompt is a prefix-cache hit
    assert second.usage.cache_read_input_tokens >= 32


def test_streamed_tool_use_arguments_add_up(api):
    with client_for(api).messages.stream(max_tokens=80, messages=ASK, tools=TOOLS,
                                         tool_choice={"type": "tool", "name": "get_weather"},
                                         **GREEDY) as stream:
        partial = "".join(event.delta.partial_json for event in stream
                          if event.type == "content_block_delta" and event.delta.type == "input_json_delta")
        final = stream.get_final_message()
    [call] = [block for block in final.content if block.type == "tool_use"]
    jsonschema.validate(call.input, SCHEMAS["get_weather"])
    assert json.loads(partial) == call.input
    assert final.stop_reason == "tool_use"


def test_count_tokens_equals_the_prompt_a_create_prefills(api):
    client = client_for(api)
    counted = client.messages.count_tokens(model=MODEL, messages=ASK, tools=TOOLS, system="Be brief.")
    message = client.messages.create(max_tokens=1, messages=ASK, tools=TOOLS, system="Be brief.", **GREEDY)
    usage = message.usage
    assert counted.input_tokens == usage.input_tokens + usage.cache_read_input_tokens > 100


def test_stop_sequence_is_reported(api):
    client = client_for(api)
    fields = dict(max_tokens=16, messages=[{"role": "user", "content": "Count from 1 to 10."}], **GREEDY)
    text = client.messages.create(**fields).content[0].text
    words = [w for w in text.split() if w.isalnum()]
    assert len(words) >= 3, text
    stop = words[2]
    message = client.messages.create(stop_sequences=[stop], **fields)
    assert message.content[0].text == text[:text.index(stop)]
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop


@pytest.mark.parametrize("body, needle", [
    ({"messages": [{"role": "user", "content": "Hi"}]}, "max_tokens"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages.0.content.0.type"),
    ({"max_tokens": 5, "messages": []}, "messages"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}], "temperature": 3}, "temperature"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}], "tool_choice": {"type": "any"}},
     "tool_choice"),
    ({"max_tokens": 100000, "messages": [{"role": "user", "content": "Hi"}]}, "context length"),
])
def test_bad_input_is_an_anthropic_400(api, body, needle):
    headers = {"x-api-key": api.api_key or "none", "anthropic-version": "2023-06-01"}
    response = httpx.post(api.url + "/v1/messages", json={"model": MODEL, **body}, headers=headers,
                          timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert needle in error["error"]["message"]


def test_sdk_raises_its_own_errors(api):
    with pytest.raises((anthropic.BadRequestError, anthropic.NotFoundError)) as info:
        client_for(api).messages.create(max_tokens=5, messages=[{"role": "user", "content": "Hi"}],
                                        model="no-such-model")
    assert info.value.body["type"] == "error" and "no-such-model" in info.value.body["error"]["message"]
    if api.api_key:
        with pytest.raises(anthropic.AuthenticationError) as auth:
            client_for(api, api_key="wrong").messages.create(
                max_tokens=5, messages=[{"role": "user", "content": "Hi"}], model=MODEL)
        assert auth.value.body == {"type": "error", "error": {
            "type": "authentication_error", "message": auth.value.body["error"]["message"]}}


def test_output_config_json_schema_is_followed(api):
    schema = {"type": "object", "properties": {"fruit": {"type": "string", "maxLength": 20}},
              "required": ["fruit"], "additionalProperties": False}
    message = client_for(api).messages.create(
        max_tokens=40, messages=[{"role": "user", "content": "Name a fruit as JSON."}],
        output_config={"format": {"type": "json_schema", "schema": schema}}, **GREEDY)
    jsonschema.validate(json.loads(message.content[0].text), schema)


def test_disconnect_mid_stream_aborts_and_frees_kv(api, server):
    generated_before = server.wait_idle_and_whole()["num_generation_tokens"]
    body = {"model": MODEL, "max_tokens": 400, "stream": True, "temperature": 0, "messages": [
        {"role": "user", "content": "Write a very long story about a dragon who learns to cook."}]}
    headers = {"x-api-key": api.api_key or "none", "anthropic-version": "2023-06-01"}
    with httpx.stream("POST", api.url + "/v1/messages", json=body, headers=headers,
                      timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        received = [next(lines) for _ in range(12)]
        assert "event: content_block_delta" in received
    report = server.wait_idle_and_whole(timeout=60)
    assert report["num_requests_inflight"] == 0 and report["kv_pool_is_whole"] is True
    assert report["num_generation_tokens"] - generated_before < 400


def test_count_tokens_of_an_unknown_model_is_an_anthropic_error(api):
    with pytest.raises((anthropic.BadRequestError, anthropic.NotFoundError)) as info:
        client_for(api).messages.count_tokens(model="no-such-model", messages=ASK)
    assert info.value.body["type"] == "error" and "no-such-model" in info.value.body["error"]["message"]

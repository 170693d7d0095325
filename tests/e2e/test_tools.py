"""Tool calls and structured output with the 135M default model: grammar-constrained decoding
must make every call's arguments validate against the function's schema, streamed or not."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.e2e.conftest import MODEL

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "days", "unit"],
    "additionalProperties": False,
}
SEARCH = {
    "type": "object",
    "properties": {"query": {"type": "string", "maxLength": 60}},
    "required": ["query"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast for a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "web_search", "description": "Search the web",
                                      "parameters": SEARCH}},
]
SCHEMAS = {"get_weather": WEATHER, "web_search": SEARCH}
ASK = [{"role": "user", "content": "What will the weather be in Paris for the next 3 days?"}]


def assemble_stream(stream) -> tuple[str, dict[int, dict], str | None]:
    """(content, {index: {id, name, arguments}}, finish_reason); checks OpenAI's delta order."""
    content, calls, reason = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                if delta.index not in calls:  # first delta: id, type, name
                    assert delta.id and delta.type == "function" and delta.function.name
                    calls[delta.index] = {"id": delta.id, "name": delta.function.name,
                                          "arguments": delta.function.arguments or ""}
                else:
                    assert delta.id is None and delta.function.name is None
                    calls[delta.index]["arguments"] += delta.function.arguments
            reason = choice.finish_reason or reason
    return content, calls, reason


def check_call(name: str, arguments: str) -> dict:
    assert name in SCHEMAS
    args = json.loads(arguments)
    jsonschema.validate(args, SCHEMAS[name])
    return args


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_call_validates_streamed_and_not(client, tool_choice):
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=tool_choice, max_tokens=120,
                  temperature=0)
    response = client.chat.completions.create(**kwargs)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls
    assert len(calls) == 1 and calls[0].id.startswith("call_") and calls[0].type == "function"
    if isinstance(tool_choice, dict):
        assert calls[0].function.name == "get_weather"
    check_call(calls[0].function.name, calls[0].function.arguments)

    content, streamed, reason = assemble_stream(client.chat.completions.create(**kwargs, stream=True))
    assert reason == "tool_calls" and list(streamed) == [0]
    assert streamed[0]["name"] == calls[0].function.name
    assert streamed[0]["arguments"] == calls[0].function.arguments  # greedy: same text both ways
    assert (choice.message.content or "") == content


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_forced_tool_call_validates_when_sampling(client, seed):
    response = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                              tool_choice="required", max_tokens=120,
                                              temperature=1.0, seed=seed)
    choice = response.choices[0]
    # `required`: exactly what the grammar allows, one call whatever was sampled
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.id.startswith("call_") and call.type == "function"
    check_call(call.function.name, call.function.arguments)


def test_auto_tool_choice_calls_are_valid_if_made(client):
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=120, temperature=0)
    response = client.chat.completions.create(**kwargs)
    choice = response.choices[0]
    for call in choice.message.tool_calls or []:
        check_call(call.function.name, call.function.arguments)
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
    content, streamed, reason = assemble_stream(client.chat.completions.create(**kwargs, stream=True))
    assert reason == choice.finish_reason
    assert [c["arguments"] for c in streamed.values()] == [
        c.function.arguments for c in choice.message.tool_calls or []]
    assert (choice.message.content or "") == content


def test_tool_history_round_trip(client):
    """An agent turn: the call and its result go back in; the model answers or calls again."""
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather",
                          "arguments": '{"city": "Paris", "days": 3, "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"forecast": "sunny, 24C"}'},
    ]
    response = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                              max_tokens=30, temperature=0)
    assert response.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert response.usage.prompt_tokens > 150  # tools section + history were rendered


def test_tool_choice_none_never_calls(client):
    response = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                              tool_choice="none", max_tokens=20, temperature=0)
    assert response.choices[0].message.tool_calls is None


def test_json_schema_response_format_validates(client):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 30}, "age": {"type": "integer"},
                       "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20},
                                   "maxItems": 3}},
        "required": ["name", "age", "hobbies"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}
    for seed in (0, 1):
        response = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Invent a person."}],
            max_tokens=150, temperature=0.7, seed=seed, response_format=fmt)
        choice = response.choices[0]
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_schema_with_completions_endpoint(client):
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"]}
    response = client.completions.create(
        model=MODEL, prompt="Is the sky blue? Answer in JSON:", max_tokens=20, temperature=0,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}})
    jsonschema.validate(json.loads(response.choices[0].text), schema)

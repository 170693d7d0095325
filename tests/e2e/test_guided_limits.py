"""Structured-output limits at the HTTP edge: over-limit or uncompilable schemas are 400s.

Limit checks run before a compile (an immediate rejection); a schema that passes them but fails
to compile is rejected when its compile ends (the engine core defers the AddResult), so both
arrive as the same OpenAI 400 before any response byte, and the worker is idle and whole after.
"""

from __future__ import annotations

import openai
import pytest

from tests.e2e.conftest import MODEL

MESSAGES = [{"role": "user", "content": "Give me JSON"}]


def response_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def weather_tool(parameters: dict) -> dict:
    return {"type": "function", "function": {"name": "get_weather", "parameters": parameters}}


@pytest.mark.parametrize("schema, message", [
    ({"type": "object", "properties": {"a": {"type": "string", "maxLength": 200000}}},
     "maxLength 200000 is over the limit"),
    ({"type": "array", "items": {"type": "integer"}, "minItems": 10**9}, "minItems"),
    ({"type": "string", "pattern": "^x{1000000}$"}, "repetition"),
])
def test_over_limit_schema_is_400(client, server, schema, message):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5,
                                       response_format=response_format(schema))
    assert message in info.value.message
    assert info.value.param == "response_format"
    report = server.wait_idle_and_whole()
    assert report["num_waiting"] == 0 and report["kv_pool_is_whole"] is True


def test_over_limit_tool_schema_is_400(client, server):
    tool = weather_tool({"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 200000}}})
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, tools=[tool],
                                       tool_choice="required")
    assert "over the limit" in info.value.message and info.value.param == "tools"


def test_schema_that_fails_to_compile_is_400_and_the_next_request_runs(client, server):
    schema = {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}, "required": ["a"]}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5,
                                       response_format=response_format(schema))
    assert info.value.param == "response_format" and "json_schema" in info.value.message
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    assert reply.choices[0].finish_reason in ("stop", "length")
    report = server.wait_idle_and_whole()
    assert report["num_waiting"] == 0 and report["kv_pool_is_whole"] is True

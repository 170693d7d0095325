"""The OpenAI Responses API with the official `openai` client and `openai-agents` (its default,
Responses-based provider), against a real worker and through the router in front of it.

Every test runs on both: the worker translates into its chat request in-process, the router
translates at its edge and runs its own chat pipeline (routing, stitching). After each one the
worker is idle and its KV pool whole.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.e2e.conftest import MODEL
from tests.e2e.test_tools import SCHEMAS, WEATHER

TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather forecast for a city",
          "parameters": WEATHER}]
ASK = "What will the weather be in Paris for the next 3 days?"
GREEDY = dict(model=MODEL, temperature=0)


@pytest.fixture(params=["worker", "router"])
def api(request, server, edge_router):
    yield server if request.param == "worker" else edge_router
    report = server.wait_idle_and_whole()
    assert report["num_requests_inflight"] == 0 and report["kv_pool_is_whole"] is True, report


def test_create_returns_a_completed_message_with_usage(api):
    response = api.client().responses.create(input="Name a fruit.", max_output_tokens=12, **GREEDY)
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.status in ("completed", "incomplete")
    [item] = response.output
    assert item.type == "message" and item.role == "assistant"
    assert response.output_text and item.content[0].type == "output_text"
    usage = response.usage
    assert usage.input_tokens > 5 and 0 < usage.output_tokens <= 12
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    # Asked again, the prompt's full 16-token blocks are cached, all but its last token's.
    again = api.client().responses.create(input="Name a fruit.", max_output_tokens=12,
                                          **GREEDY).usage
    assert again.input_tokens_details.cached_tokens == (usage.input_tokens - 1) // 16 * 16


def test_stream_has_the_documented_event_sequence_and_the_same_text(api):
    client = api.client()
    plain = client.responses.create(input="Name a color.", max_output_tokens=10, **GREEDY)
    events = list(client.responses.create(input="Name a color.", max_output_tokens=10, stream=True,
                                          **GREEDY))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", types[-1]]
    assert types[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    final = events[-1].response
    assert text == done.text == final.output_text == plain.output_text
    assert final.usage.output_tokens == plain.usage.output_tokens
    assert final.usage.input_tokens == plain.usage.input_tokens


def test_function_call_then_output_with_previous_response_id(api):
    client = api.client()
    first = client.responses.create(input=ASK, tools=TOOLS, tool_choice="required",
                                    max_output_tokens=80, **GREEDY)
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), SCHEMAS["get_weather"])
    result = {"type": "function_call_output", "call_id": call.call_id,
              "output": json.dumps({"forecast": "sunny", "high_c": 21})}
    follow = client.responses.create(previous_response_id=first.id, input=[result], tools=TOOLS,
                                     max_output_tokens=20, **GREEDY)
    assert follow.previous_response_id == first.id and follow.output_text
    # the same conversation sent whole gives the same prompt, and the stored turn is a cache hit
    full = client.responses.create(
        input=[{"role": "user", "content": ASK},
               {"type": "function_call", "call_id": call.call_id, "name": call.name,
                "arguments": call.arguments}, result],
        tools=TOOLS, max_output_tokens=20, **GREEDY)
    assert full.usage.input_tokens == follow.usage.input_tokens
    assert full.output_text == follow.output_text
    assert follow.usage.input_tokens_details.cached_tokens >= 32


def test_streamed_function_call_arguments_add_up(api):
    events = list(api.client().responses.create(
        input=ASK, tools=TOOLS, tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=80, stream=True, **GREEDY))
    added = [e for e in events if e.type == "response.output_item.added"
             and e.item.type == "function_call"]
    assert len(added) == 1 and added[0].item.name == "get_weather"
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    item_done = next(e for e in events if e.type == "response.output_item.done"
                     and e.item.type == "function_call")
    assert deltas == done.arguments == item_done.item.arguments
    assert done.item_id == added[0].item.id == item_done.item.id
    jsonschema.validate(json.loads(deltas), SCHEMAS["get_weather"])
    assert events[-1].type == "response.completed"
    assert events[-1].response.output[-1].arguments == deltas


def test_text_format_json_schema_is_followed(api):
    schema = {"type": "object", "properties": {"fruit": {"type": "string", "maxLength": 20}},
              "required": ["fruit"], "additionalProperties": False}
    response = api.client().responses.create(
        input="Name a fruit as JSON.", max_output_tokens=40, instructions="Answer in JSON.",
        text={"format": {"type": "json_schema", "name": "fruit", "schema": schema, "strict": True}},
        **GREEDY)
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.text.format.type == "json_schema"


def test_max_output_tokens_makes_an_incomplete_response(api):
    response = api.client().responses.create(input="Tell me a long story about a dragon.",
                                             max_output_tokens=3, **GREEDY)
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3


def test_retrieve_a_stored_response_and_store_false_keeps_nothing(api):
    client = api.client()
    stored = client.responses.create(input="Name an animal.", max_output_tokens=5, **GREEDY)
    assert client.responses.retrieve(stored.id).output_text == stored.output_text
    unstored = client.responses.create(input="Name an animal.", max_output_tokens=5, store=False,
                                       **GREEDY)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(input="Hi", previous_response_id=unstored.id, max_output_tokens=2,
                                **GREEDY)
    error = info.value.body
    assert error["param"] == "previous_response_id" and error["code"] == "previous_response_not_found"


@pytest.mark.parametrize("body, param", [
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input.0.content.0.type"),
    ({"input": "Hi", "temperature": "hot"}, "temperature"),
    ({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"input": "Hi", "tool_choice": "required"}, "tool_choice"),
    ({"input": "Hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input.0.arguments"),
    ({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
])
def test_bad_input_is_an_openai_400_naming_the_field(api, body, param):
    headers = {**api.headers(), "content-type": "application/json"}
    response = httpx.post(api.url + "/v1/responses", json={"model": MODEL, **body}, headers=headers,
                          timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
    assert error["type"] == "invalid_request_error"


def weather_agent(api):
    """An openai-agents Agent with one function tool, on the default (Responses API) provider;
    returns (agent, run config, the cities the tool was called with)."""
    from agents import Agent, ModelSettings, RunConfig, function_tool
    from agents.models.openai_provider import OpenAIProvider

    calls = []

    @function_tool
    def get_weather(city: str) -> str:
        """Weather forecast for a city."""
        calls.append(city)
        return f"It is sunny in {city}."

    agent = Agent(name="weather", instructions="Use the tools to answer.", tools=[get_weather],
                  model=MODEL, model_settings=ModelSettings(tool_choice="required", temperature=0,
                                                            max_tokens=60))
    provider = OpenAIProvider(openai_client=api.async_client())  # default: the Responses API
    return agent, RunConfig(model_provider=provider, tracing_disabled=True), calls


async def test_openai_agents_default_provider_runs_a_function_tool(api):
    from agents import Runner

    agent, run_config, calls = weather_agent(api)
    result = await Runner.run(agent, "What is the weather in Paris?", max_turns=4,
                              run_config=run_config)
    assert len(calls) == 1 and calls[0]
    assert isinstance(result.final_output, str)
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item"


STORY = "Write a very long story about a dragon who learns to cook, with many chapters."


def test_disconnect_mid_stream_aborts_and_frees_kv(api, server):
    generated_before = server.wait_idle_and_whole()["num_generation_tokens"]
    body = {"model": MODEL, "input": STORY, "max_output_tokens": 400, "stream": True, "temperature": 0}
    with httpx.stream("POST", api.url + "/v1/responses", json=body, headers=api.headers(),
                      timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        received = [next(lines) for _ in range(18)]  # a few events, then hang up
        assert "event: response.output_text.delta" in received
    report = server.wait_idle_and_whole(timeout=60)
    assert report["num_requests_inflight"] == 0 and report["kv_pool_is_whole"] is True
    assert report["num_generation_tokens"] - generated_before < 400


def test_disconnect_during_non_stream_aborts(server):
    body = {"model": MODEL, "input": STORY, "max_output_tokens": 400, "temperature": 0}
    with httpx.Client(timeout=httpx.Timeout(60, read=1.0)) as client:
        with pytest.raises(httpx.ReadTimeout):  # the client gives up and hangs up
            client.post(server.url + "/v1/responses", json=body, headers=server.headers())
    report = server.wait_idle_and_whole(timeout=60)
    assert report["num_requests_inflight"] == 0 and report["kv_pool_is_whole"] is True


async def test_openai_agents_streamed_run(api):
    from agents import Runner

    agent, run_config, calls = weather_agent(api)
    result = Runner.run_streamed(agent, "What is the weather in Paris?", max_turns=4,
                                 run_config=run_config)
    kinds = [event.item.type async for event in result.stream_events()
             if event.type == "run_item_stream_event"]
    assert len(calls) == 1
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item"
    assert isinstance(result.final_output, str)

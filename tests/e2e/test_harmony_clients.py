"""gpt-oss's harmony format through the official `anthropic` client and the OpenAI Agents SDK,
against conftest's `gpt_oss_served` (a tiny random gpt-oss folder with a harmony tokenizer,
shared with test_gpt_oss_serve.py). Random weights write random text, so each turn's output is
held to a regex (`structured_outputs`, tests/e2e/harmony_model.py): an analysis message, then a
call of get_weather or a final answer.

    Messages API   the analysis channel is a `thinking` block, a commentary call a `tool_use`
                   block, never text; streamed the same as not; usage as the Chat API counts it;
                   the thinking block sent back is written into the prompt while its tool loop
                   runs (and dropped once a new user message follows, as gpt-oss was trained)
    Agents SDK     an Agent with a function tool runs to its final answer through
                   OpenAIChatCompletionsModel and OpenAIResponsesModel, streamed and not, with
                   the reasoning as reasoning items and the call's arguments as the grammar wrote
    Bad input      a malformed thinking block, a tool_result answering no call: a 400 naming the
                   field; a stream dropped midway: the pool whole and nothing queued afterwards
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Annotated

import anthropic
import httpx
import pytest
from pydantic import Field

from tests.e2e.conftest import MODEL
from tests.e2e.harmony_model import FORCED, FORCED_ANSWER, forced
from tests.e2e.test_tools import ASK

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        "additionalProperties": False}
TOOL = {"name": "get_weather", "description": "Weather forecast for a city", "input_schema": CITY}
CHAT_TOOLS = [{"type": "function", "function": {"name": TOOL["name"],
                                                 "description": TOOL["description"],
                                                 "parameters": CITY}}]
REASONING = re.compile(r"[a-z ]{3,24}")
CITY_NAME = re.compile(r"[A-Z][a-z]{1,8}")
ANSWER = re.compile(r"[a-z ]{1,16}")
HEADERS = {"x-api-key": "none", "anthropic-version": "2023-06-01"}


def anthropic_client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=120)


def messages_kwargs(regex: str, messages=ASK, **extra) -> dict:
    return dict(model=MODEL, max_tokens=160, messages=messages, tools=[TOOL],
                extra_body={"temperature": 0, **forced(regex)}, **extra)


def assert_settled(server) -> dict:
    """Nothing in flight or queued, and every KV block back in the pool."""
    report = server.wait_idle_and_whole()
    assert report["kv_pool_is_whole"] is True, report
    assert (report["num_requests_inflight"], report["num_running"], report["num_waiting"]) \
        == (0, 0, 0), report
    return report


# ---- the Messages API --------------------------------------------------------------------------


def test_thinking_and_tool_use_blocks_streamed_and_not(gpt_oss_served):
    server, _ = gpt_oss_served
    client = anthropic_client(server)
    message = client.messages.create(**messages_kwargs(FORCED))
    assert [block.type for block in message.content] == ["thinking", "tool_use"]
    thinking, call = message.content
    assert REASONING.fullmatch(thinking.thinking) and thinking.signature == ""
    assert call.name == "get_weather" and call.id and list(call.input) == ["city"]
    assert CITY_NAME.fullmatch(call.input["city"])
    assert message.stop_reason == "tool_use"

    # the same request through the Chat API: the same reasoning and call, the same counts
    chat = server.client().chat.completions.create(
        model=MODEL, messages=ASK, tools=CHAT_TOOLS, max_tokens=160, temperature=0,
        extra_body=forced(FORCED))
    assert chat.choices[0].message.reasoning_content == thinking.thinking
    [chat_call] = chat.choices[0].message.tool_calls
    assert json.loads(chat_call.function.arguments) == call.input
    assert message.usage.output_tokens == chat.usage.completion_tokens
    assert message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0) \
        == chat.usage.prompt_tokens == client.messages.count_tokens(
            model=MODEL, messages=ASK, tools=[TOOL]).input_tokens

    # as an Anthropic client asks for reasoning (accepted; harmony always reasons)
    thinking_on = {"type": "enabled", "budget_tokens": 1024}
    with client.messages.stream(**messages_kwargs(FORCED), thinking=thinking_on) as stream:
        events = list(stream)
        final = stream.get_final_message()
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == ["thinking", "tool_use"]
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert "".join(d.thinking for d in deltas if d.type == "thinking_delta") == thinking.thinking
    assert json.loads("".join(d.partial_json for d in deltas if d.type == "input_json_delta")) \
        == call.input
    assert not [d for d in deltas if d.type == "text_delta"]
    assert [b.model_dump(exclude={"id"}) for b in final.content] \
        == [b.model_dump(exclude={"id"}) for b in message.content]
    assert final.stop_reason == "tool_use" and final.usage.output_tokens == message.usage.output_tokens


def test_thinking_goes_back_into_the_tool_loop_and_a_tool_result_turn_answers(gpt_oss_served):
    server, _ = gpt_oss_served
    client = anthropic_client(server)
    first = client.messages.create(**messages_kwargs(FORCED))
    thinking, call = first.content
    turn = {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]}
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                           "content": "Sunny, 21 C."}]}
    history = [*ASK, turn, result]
    without = [*ASK, {"role": "assistant", "content": turn["content"][1:]}, result]

    def count(messages) -> int:
        return client.messages.count_tokens(model=MODEL, messages=messages,
                                            tools=[TOOL]).input_tokens

    # while the tool loop runs, the reasoning is in the prompt: its analysis message, exactly
    analysis = f"<|start|>assistant<|channel|>analysis<|message|>{thinking.thinking}<|end|>"
    num_analysis = len(httpx.post(server.url + "/tokenize", json={"prompt": analysis},
                                  timeout=60).json()["tokens"])
    assert count(history) - count(without) == num_analysis
    # once the user speaks again, that turn's reasoning is dropped
    later = [{"role": "user", "content": "And tomorrow?"}]
    assert count([*history, {"role": "assistant", "content": "sunny"}, *later]) == count(
        [*without, {"role": "assistant", "content": "sunny"}, *later])

    second = client.messages.create(**messages_kwargs(FORCED_ANSWER, messages=history))
    assert [block.type for block in second.content] == ["thinking", "text"]
    assert REASONING.fullmatch(second.content[0].thinking)
    assert ANSWER.fullmatch(second.content[1].text) and second.stop_reason == "end_turn"
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == count(history)
    assert second.usage.cache_read_input_tokens > 0  # the first turn's prompt is a prefix of it


@pytest.mark.parametrize("block, field", [
    ({"type": "thinking", "thinking": 7, "signature": ""}, "messages.1.content.0.thinking"),
    ({"type": "thinking"}, "messages.1.content.0.thinking"),
])
def test_a_malformed_thinking_block_is_a_400_naming_it(gpt_oss_served, block, field):
    server, _ = gpt_oss_served
    body = {"model": MODEL, "max_tokens": 8, "messages": [
        *ASK, {"role": "assistant", "content": [block, {"type": "text", "text": "Hi."}]},
        {"role": "user", "content": "Go on."}]}
    reply = httpx.post(server.url + "/v1/messages", json=body, headers=HEADERS, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert field in error["error"]["message"]
    assert_settled(server)


def test_thinking_in_a_user_turn_is_a_400_naming_its_type(gpt_oss_served):
    server, _ = gpt_oss_served
    with pytest.raises(anthropic.BadRequestError) as info:
        anthropic_client(server).messages.create(model=MODEL, max_tokens=8, messages=[
            {"role": "user", "content": [{"type": "thinking", "thinking": "x", "signature": ""}]}])
    assert "messages.0.content.0.type" in info.value.message


def test_a_tool_result_answering_no_call_is_a_400(gpt_oss_served):
    """Harmony writes a result as a message from functions.NAME: with no tool_use of that id
    before it, there is no name to write."""
    server, _ = gpt_oss_served
    messages = [*ASK, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_nowhere", "content": "Sunny."}]}]
    client = anthropic_client(server)
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model=MODEL, max_tokens=8, messages=messages, tools=[TOOL])
    assert "tool_call_id" in info.value.message and "toolu_nowhere" in info.value.message
    with pytest.raises(anthropic.BadRequestError):
        client.messages.count_tokens(model=MODEL, messages=messages, tools=[TOOL])
    assert_settled(server)


def test_a_messages_stream_dropped_in_its_thinking_frees_everything(gpt_oss_served):
    server, _ = gpt_oss_served
    generated_before = assert_settled(server)["num_generation_tokens"]
    body = {"model": MODEL, "max_tokens": 400, "messages": ASK, "stream": True,
            "temperature": 0, **forced(r"<\|channel\|>analysis<\|message\|>[a-z ]{300,400}")}
    with httpx.stream("POST", server.url + "/v1/messages", json=body, headers=HEADERS,
                      timeout=60) as response:
        assert response.status_code == 200
        num_deltas = 0
        for line in response.iter_lines():
            num_deltas += "thinking_delta" in line
            if num_deltas == 3:
                break  # hang up inside the thinking block
        assert num_deltas == 3
    report = assert_settled(server)
    assert report["num_generation_tokens"] - generated_before < 400


# ---- the OpenAI Agents SDK ---------------------------------------------------------------------


def sdk_model(kind: str, server, first_turn: dict | None):
    """The SDK's own model class for `kind` on this server, each turn's output held by a regex:
    `first_turn` (None: the tool_choice grammar alone) until a tool's output is in the input,
    then an analysis message and a final answer."""
    from agents import Model, OpenAIChatCompletionsModel, OpenAIResponsesModel

    model_class = OpenAIChatCompletionsModel if kind == "chat" else OpenAIResponsesModel
    inner = model_class(model=MODEL, openai_client=server.async_client())

    def per_turn(input, settings):
        answered = not isinstance(input, str) and any(
            (item.get("type") if isinstance(item, dict) else getattr(item, "type", None))
            == "function_call_output" for item in input)
        body = forced(FORCED_ANSWER) if answered else first_turn
        return dataclasses.replace(settings, extra_body=body) if body else settings

    class ForcedTurns(Model):
        async def get_response(self, system_instructions, input, model_settings, *args, **kwargs):
            return await inner.get_response(system_instructions, input,
                                            per_turn(input, model_settings), *args, **kwargs)

        def stream_response(self, system_instructions, input, model_settings, *args, **kwargs):
            return inner.stream_response(system_instructions, input,
                                         per_turn(input, model_settings), *args, **kwargs)

    return ForcedTurns()


def weather_agent(model, tool_choice: str | None):
    from agents import Agent, ModelSettings, function_tool

    calls = []

    @function_tool
    def get_weather(city: Annotated[str, Field(max_length=12)]) -> str:
        """Weather forecast for a city."""
        calls.append(city)
        return f"It is sunny in {city}."

    agent = Agent(name="weather", instructions="Use the tools to answer.", tools=[get_weather],
                  model=model, model_settings=ModelSettings(
                      tool_choice=tool_choice, temperature=0, max_tokens=160))
    return agent, calls


async def run_agent(agent, streamed: bool):
    from agents import RunConfig, Runner

    config = RunConfig(tracing_disabled=True)
    question = "What is the weather in Paris?"
    if not streamed:
        return await Runner.run(agent, question, max_turns=4, run_config=config)
    result = Runner.run_streamed(agent, question, max_turns=4, run_config=config)
    async for _ in result.stream_events():
        pass
    return result


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "streamed"])
@pytest.mark.parametrize("kind", ["chat", "responses"])
async def test_agent_reasons_calls_the_tool_and_answers(gpt_oss_served, kind, streamed):
    from agents import ItemHelpers

    server, _ = gpt_oss_served
    agent, calls = weather_agent(sdk_model(kind, server, forced(FORCED)), tool_choice=None)
    result = await run_agent(agent, streamed)
    kinds = [item.type for item in result.new_items]
    assert kinds == ["reasoning_item", "tool_call_item", "tool_call_output_item",
                     "reasoning_item", "message_output_item"], kinds
    assert len(calls) == 1 and CITY_NAME.fullmatch(calls[0])
    for item in (result.new_items[0], result.new_items[3]):
        raw = item.raw_item
        texts = [part.text for part in (raw.content or raw.summary)]
        assert len(texts) == 1 and REASONING.fullmatch(texts[0]), raw
    assert ANSWER.fullmatch(result.final_output)
    assert ItemHelpers.text_message_output(result.new_items[-1]) == result.final_output
    assert_settled(server)


@pytest.mark.parametrize("kind", ["chat", "responses"])
async def test_agent_forced_call_follows_the_tools_schema(gpt_oss_served, kind):
    """tool_choice required: the call is the tool_choice grammar's (the SDK's strict schema of
    the function), from the first token; after the tool ran, the answer."""
    server, _ = gpt_oss_served
    agent, calls = weather_agent(sdk_model(kind, server, None), tool_choice="required")
    result = await run_agent(agent, streamed=False)
    kinds = [item.type for item in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item", "reasoning_item",
                     "message_output_item"], kinds
    [call] = [item.raw_item for item in result.new_items if item.type == "tool_call_item"]
    assert list(json.loads(call.arguments)) == ["city"] and calls == [json.loads(call.arguments)["city"]]
    assert ANSWER.fullmatch(result.final_output)
    assert_settled(server)

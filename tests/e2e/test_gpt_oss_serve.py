"""`hearth serve` on a gpt-oss model: a tiny random GptOssForCausalLM folder (sinks, a sliding
layer, biased experts) whose byte-level tokenizer has harmony's special tokens and whose chat
template writes harmony channels (tests/e2e/harmony_model.py; conftest's `gpt_oss_served`, one
server shared with test_harmony_clients.py), so `--chat-format auto` picks hearth's harmony
renderer, the tool parser `auto` the openai one and the reasoning parser openai_gptoss. Through
the official client, output forced by a regex (`structured_outputs`) into an analysis message and
a tool call comes back as reasoning_content and a tool call, streamed the same as not; the
model's own <|call|> ends the turn. A client that drops a stream midway costs nothing: the KV
pool is whole once the server is idle."""

from __future__ import annotations

import json

import httpx

from tests.e2e.conftest import MODEL
from tests.e2e.harmony_model import ENDOFTEXT, FORCED, forced
from tests.e2e.test_tools import ASK, TOOLS, assemble_stream

GREEDY = dict(model=MODEL, temperature=0)


def test_the_prompt_is_harmony(gpt_oss_served):
    server, ids = gpt_oss_served
    body = {"model": MODEL, "messages": ASK, "tools": TOOLS}
    tokens = httpx.post(server.url + "/tokenize", json=body, timeout=60).json()["tokens"]
    assert max(tokens) <= ids[ENDOFTEXT]  # the folder's own byte-level tokenizer
    # system, developer (the tools), user, then the generation prompt; one token each
    assert tokens[0] == ids["<|start|>"] and tokens.count(ids["<|start|>"]) == 4
    assert tokens.count(ids["<|end|>"]) == 3 and ids["<|channel|>"] not in tokens


def test_reasoning_and_tool_call_streamed_and_not(gpt_oss_served):
    server, _ = gpt_oss_served
    client = server.client()
    kwargs = dict(messages=ASK, tools=TOOLS, max_tokens=160, reasoning_effort="low",
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

    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    streamed_reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or ""
                                 for c in chunks if c.choices)
    content, calls, reason = assemble_stream(iter(chunks))
    assert streamed_reasoning == reasoning and content == "" and reason == "tool_calls"
    assert (calls[0]["name"], calls[0]["arguments"]) == ("get_weather", call.function.arguments)


def test_a_stream_dropped_midway_frees_its_blocks(gpt_oss_served):
    """Read a few chunks, close the connection; the fixture's teardown checks the pool."""
    server, _ = gpt_oss_served
    stream = server.client().chat.completions.create(
        messages=ASK, tools=TOOLS, max_tokens=160, stream=True,
        extra_body=forced(FORCED), **GREEDY)
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    report = server.wait_idle_and_whole()
    assert report["kv_pool_is_whole"] is True, report


def test_a_bad_regex_is_a_400(gpt_oss_served):
    server, _ = gpt_oss_served
    reply = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": ASK, "structured_outputs": {"regex": "(unclosed"}})
    assert reply.status_code == 400, reply.text

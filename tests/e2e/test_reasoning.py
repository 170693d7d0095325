"""Reasoning served for real (`--reasoning-parser deepseek_r1`): the default model under a chat
template that opens a `<think>` block for the answer, as DeepSeek-R1's does, so everything the
model writes is reasoning (it never closes the block). Through the official clients of all three
APIs, streamed and not: the reasoning comes back as each API defines it (reasoning_content,
a reasoning output item, a thinking block), never as content, counted in the usage, and a past
turn's reasoning sent back goes through the template (which drops it, as the <think> templates do).
A forced tool call is constrained from its first token, so it has no reasoning and is parsed."""

from __future__ import annotations

import json

import anthropic
import pytest

from tests.e2e.conftest import MODEL, start_server
from tests.e2e.marker_model import write_model_copy
from tests.e2e.test_tools import ASK, TOOLS

TEMPLATE = (
    "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "(message['content'] or '') + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}")
GREEDY = dict(model=MODEL, temperature=0)
HI = [{"role": "user", "content": "Why is the sky blue?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("reasoning")
    model = write_model_copy(folder / "smollm2-think.gguf", [], TEMPLATE)
    server = start_server(folder, "--model", str(model), "--served-model-name", MODEL,
                          "--reasoning-parser", "deepseek_r1", "--num-kv-blocks", "256")
    yield server
    report = server.wait_idle_and_whole()
    server.stop()
    assert report["kv_pool_is_whole"] is True, report


@pytest.fixture(scope="module")
def reference(server):
    """The non-streamed chat answer, which every other form must equal."""
    response = server.client().chat.completions.create(messages=HI, max_tokens=24, **GREEDY)
    return response


def test_chat_completion_returns_reasoning_apart_from_content(reference):
    choice = reference.choices[0]
    assert choice.message.content is None
    assert isinstance(choice.message.reasoning_content, str) and choice.message.reasoning_content
    assert "<think>" not in choice.message.reasoning_content
    assert choice.finish_reason == "length"
    usage = reference.usage
    assert usage.completion_tokens == 24
    assert usage.completion_tokens_details.reasoning_tokens == 24


def test_chat_stream_sends_reasoning_deltas(server, reference):
    stream = server.client().chat.completions.create(
        messages=HI, max_tokens=24, stream=True, stream_options={"include_usage": True}, **GREEDY)
    reasoning, content, usage = "", "", None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            content += choice.delta.content or ""
    assert content == ""
    assert reasoning == reference.choices[0].message.reasoning_content
    assert usage.completion_tokens_details.reasoning_tokens == 24


def test_forced_tool_call_has_no_reasoning(server):
    response = server.client().chat.completions.create(
        messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=120, **GREEDY)
    message = response.choices[0].message
    assert response.choices[0].finish_reason == "tool_calls"
    assert message.reasoning_content is None and message.content is None
    [call] = message.tool_calls
    json.loads(call.function.arguments)
    assert response.usage.completion_tokens_details.reasoning_tokens == 0


def test_responses_reasoning_item_streamed_and_not(server, reference):
    client = server.client()
    text = reference.choices[0].message.reasoning_content
    response = client.responses.create(input="Why is the sky blue?", max_output_tokens=24,
                                       temperature=0, model=MODEL)
    [item] = response.output
    assert item.type == "reasoning" and item.summary == []
    assert [part.text for part in item.content] == [text]
    assert response.output_text == ""
    assert response.usage.output_tokens_details.reasoning_tokens == 24
    events = list(client.responses.create(input="Why is the sky blue?", max_output_tokens=24,
                                          temperature=0, model=MODEL, stream=True))
    kinds = [event.type for event in events]
    assert "response.output_text.delta" not in kinds
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    [done] = [e for e in events if e.type == "response.reasoning_text.done"]
    assert deltas == done.text == text
    assert events[-1].response.output[0].content[0].text == text

    # the next turn, by previous_response_id or by sending the items back: the same prompt,
    # which is the prompt of an empty assistant turn (the template drops past reasoning)
    follow = client.responses.create(input="And at night?", previous_response_id=response.id,
                                     max_output_tokens=4, temperature=0, model=MODEL)
    first = {"type": "message", "role": "user", "content": "Why is the sky blue?"}
    then = {"type": "message", "role": "user", "content": "And at night?"}
    resent = client.responses.create(input=[first, item.model_dump(exclude_none=True), then],
                                     max_output_tokens=4, temperature=0, model=MODEL)
    empty = client.responses.create(
        input=[first, {"type": "message", "role": "assistant", "content": ""}, then],
        max_output_tokens=4, temperature=0, model=MODEL)
    assert follow.usage.input_tokens == resent.usage.input_tokens == empty.usage.input_tokens
    assert follow.output[0].content[0].text == resent.output[0].content[0].text


def test_anthropic_thinking_blocks(server, reference):
    client = anthropic.Anthropic(base_url=server.url, api_key=server.api_key or "none",
                                 max_retries=0, timeout=120)
    text = reference.choices[0].message.reasoning_content
    kwargs = dict(model=MODEL, max_tokens=24, extra_body={"temperature": 0},
                  messages=[{"role": "user", "content": "Why is the sky blue?"}])
    message = client.messages.create(**kwargs)
    [block] = message.content
    assert block.type == "thinking" and block.thinking == text and block.signature == ""
    assert message.stop_reason == "max_tokens"
    with client.messages.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking"] and final.content[0].thinking == text
    starts = [e for e in events if e.type == "content_block_start"]
    assert [e.content_block.type for e in starts] == ["thinking"]
    thinking = "".join(e.delta.thinking for e in events
                       if e.type == "content_block_delta" and e.delta.type == "thinking_delta")
    assert thinking == text

    # the thinking block back in history: read, handed to the template (which drops it)
    history = [{"role": "user", "content": "Why is the sky blue?"},
               {"role": "assistant", "content": [block.model_dump(), {"type": "text", "text": "Air."}]},
               {"role": "user", "content": "And at night?"}]
    plain = [history[0], {"role": "assistant", "content": "Air."}, history[2]]
    with_thinking = client.messages.count_tokens(model=MODEL, messages=history)
    assert with_thinking.input_tokens == client.messages.count_tokens(
        model=MODEL, messages=plain).input_tokens
    again = client.messages.create(model=MODEL, max_tokens=4, messages=history,
                                   extra_body={"temperature": 0})
    assert again.content[0].type == "thinking"

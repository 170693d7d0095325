"""Chat completions through the official openai SDK against a real server process."""

from __future__ import annotations

import asyncio

import pytest

from tests.e2e.conftest import MODEL

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def collect_stream(stream) -> tuple[dict[int, str], dict[int, str], list]:
    """(text per choice, finish_reason per choice, all chunks)."""
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    chunks = list(stream)
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    return texts, reasons, chunks


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_chat_greedy_answers_and_reports_usage(client):
    response = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12,
                                              temperature=0)
    choice = response.choices[0]
    assert "Paris" in choice.message.content
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    usage = response.usage
    assert usage.prompt_tokens > 10 and 0 < usage.completion_tokens <= 12
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    # Asked again, the prompt's full 16-token blocks are cached, all but its last token's.
    again = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12,
                                           temperature=0).usage
    assert again.prompt_tokens_details.cached_tokens == (usage.prompt_tokens - 1) // 16 * 16


def test_stream_equals_non_stream_and_has_openai_shape(client):
    kwargs = dict(model=MODEL, messages=QUESTION, max_tokens=12, temperature=0)
    full = client.chat.completions.create(**kwargs)
    stream = client.chat.completions.create(**kwargs, stream=True,
                                            stream_options={"include_usage": True})
    texts, reasons, chunks = collect_stream(stream)
    assert texts[0] == full.choices[0].message.content
    assert reasons[0] == full.choices[0].finish_reason
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1 and all(c.object == "chat.completion.chunk" for c in chunks)
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == full.usage.completion_tokens
    assert usage_chunk.usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_without_include_usage_has_no_usage_chunk(client):
    stream = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4,
                                            temperature=0, stream=True)
    _, reasons, chunks = collect_stream(stream)
    assert reasons[0] in ("stop", "length") and all(c.choices for c in chunks)


def test_content_part_arrays_render_like_strings(client):
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is the capital"},
                                          {"type": "text", "text": "of France?"}]}]
    joined = [{"role": "user", "content": "What is the capital\nof France?"}]
    a = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=8, temperature=0)
    b = client.chat.completions.create(model=MODEL, messages=joined, max_tokens=8, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.prompt_tokens == b.usage.prompt_tokens


def test_n_choices_with_seed_are_reproducible_and_distinct(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Write a word."}],
                  max_tokens=8, temperature=1.0, n=3, seed=1234)
    first = client.chat.completions.create(**kwargs)
    again = client.chat.completions.create(**kwargs)
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in again.choices]
    assert len(set(texts)) > 1  # each choice samples with its own seed
    single = client.chat.completions.create(**{**kwargs, "n": 1})
    assert first.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt counts once


def test_n_choices_stream_interleaves_every_index(client):
    stream = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=6,
                                            temperature=0.8, seed=7, n=2, stream=True)
    texts, reasons, _ = collect_stream(stream)
    assert set(texts) == {0, 1} and set(reasons) == {0, 1}


def test_different_seeds_differ(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}],
                  max_tokens=12, temperature=1.0)
    outputs = {client.chat.completions.create(**kwargs, seed=s).choices[0].message.content
               for s in range(3)}
    assert len(outputs) > 1


def test_stop_string_ends_output_before_it(client):
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count from 1 to 10, separated by commas."}],
        max_tokens=40, temperature=0, stop=["5"])
    choice = response.choices[0]
    assert choice.finish_reason == "stop" and "5" not in choice.message.content


def test_logprobs_are_consistent_with_greedy_choice(client):
    response = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=5,
                                              temperature=0, logprobs=True, top_logprobs=3)
    entries = response.choices[0].logprobs.content
    assert len(entries) == response.usage.completion_tokens
    assert "".join(e.token for e in entries).startswith(response.choices[0].message.content[:3])
    for entry in entries:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.top_logprobs[0].token == entry.token  # greedy picks the best
        if entry.token.isascii():
            assert bytes(entry.bytes).decode("utf-8") == entry.token


def test_streamed_logprobs(client):
    stream = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=5,
                                            temperature=0, logprobs=True, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    entries = [e for chunk in chunks for c in chunk.choices if c.logprobs for e in c.logprobs.content]
    assert len(entries) == chunks[-1].usage.completion_tokens
    assert all(e.logprob <= 0 for e in entries)


def test_cached_tokens_rise_on_a_repeated_prefix(client):
    system = "You are a careful assistant. " * 20  # ~120 tokens: several full KV blocks
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Hi there!"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    messages[1]["content"] = "Hello again, friend."
    second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    cached_first = first.usage.prompt_tokens_details.cached_tokens
    cached_second = second.usage.prompt_tokens_details.cached_tokens
    assert cached_second > cached_first and cached_second >= 100
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    usage = list(stream)[-1].usage
    assert usage.prompt_tokens_details.cached_tokens >= cached_second


def test_async_client_concurrent_requests(server):
    async def main():
        async with server.async_client() as client:
            prompts = [f"Name a color number {i}." for i in range(4)]
            tasks = [client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": p}], max_tokens=6, temperature=0)
                for p in prompts]
            responses = await asyncio.gather(*tasks)
            stream = await client.chat.completions.create(model=MODEL, messages=QUESTION,
                                                          max_tokens=4, temperature=0, stream=True)
            chunks = [chunk async for chunk in stream]
            return responses, chunks

    responses, chunks = asyncio.run(main())
    assert all(r.choices[0].message.content for r in responses)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("fmt", ["json_object"])
def test_json_object_response_format_is_json(client, fmt):
    import json

    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe a cat as JSON."}],
        max_tokens=60, temperature=0, response_format={"type": fmt})
    if response.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(response.choices[0].message.content), dict)

"""SSE stitching on recorded chunk sequences (the shapes hearth/api/chat_chunks.py writes)."""

from __future__ import annotations

import json

from hearth.router.stitch import DONE, FirstToken, Stitcher, parse_sse_data

WORKER_ID, ROUTER_ID = "chatcmpl-worker", "chatcmpl-router"


def chat_chunk(delta: dict, finish: str | None = None, logprobs: dict | None = None,
               index: int = 0) -> dict:
    return {"id": WORKER_ID, "object": "chat.completion.chunk", "created": 1, "model": "m",
            "system_fingerprint": None, "usage": None,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}


def text_chunk(text: str, finish: str | None = None, logprobs: dict | None = None) -> dict:
    return {"id": "cmpl-worker", "object": "text_completion", "created": 1, "model": "m", "usage": None,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}]}


def usage_chunk(prompt: int, completion: int, cached: int) -> dict:
    return {"id": WORKER_ID, "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                      "total_tokens": prompt + completion,
                      "prompt_tokens_details": {"cached_tokens": cached}},
            "kv_transfer": {"num_transferred_tokens": 4, "num_transferred_blocks": 1,
                            "num_transferred_bytes": 100}}


def prefill_response(content: str, prompt: int = 20, cached: int = 16, logprobs: dict | None = None) -> dict:
    return {"id": "chatcmpl-prefill", "object": "chat.completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                         "logprobs": logprobs, "finish_reason": "length"}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": 1, "total_tokens": prompt + 1,
                      "prompt_tokens_details": {"cached_tokens": cached}},
            "kv_transfer": {"first_token_id": 7}}


def decode_parsed(chunks: list[str]) -> list:
    return [parse_sse_data(c.strip()) for c in chunks]


def run(stitcher: Stitcher, first: dict | None, events: list[dict], chat: bool = True) -> list:
    out = stitcher.prefill_chunks(FirstToken.from_response(first, chat)) if first else []
    for event in events:
        out += stitcher.decode_event(event)
    return decode_parsed(out + stitcher.done_chunks())


def content_of(chunks: list) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                   if isinstance(c, dict) and c.get("choices"))


def test_pd_stream_has_one_id_one_role_chunk_and_merged_usage():
    stitcher = Stitcher(ROUTER_ID, 1234, "m", chat=True, include_usage=True)
    decode = [chat_chunk({"role": "assistant", "content": ""}), chat_chunk({"content": " world"}),
              chat_chunk({"content": "!"}), chat_chunk({}, "stop"), usage_chunk(20, 3, 0)]
    chunks = run(stitcher, prefill_response("Hello"), decode)
    assert chunks[-1] is DONE
    body = chunks[:-1]
    assert {c["id"] for c in body} == {ROUTER_ID} and {c["created"] for c in body} == {1234}
    roles = [c for c in body if c["choices"] and "role" in c["choices"][0]["delta"]]
    assert len(roles) == 1 and body[0] is roles[0]
    assert body[1]["choices"][0]["delta"] == {"content": "Hello"}  # the first token, sent at once
    assert content_of(body) == "Hello world!"
    assert body[-2]["choices"][0]["finish_reason"] == "stop"
    # prompt and cached tokens from the prefill side; completion tokens from decode (first once)
    assert body[-1]["choices"] == [] and body[-1]["usage"] == {
        "prompt_tokens": 20, "completion_tokens": 3, "total_tokens": 23,
        "prompt_tokens_details": {"cached_tokens": 16}}
    assert all(c["usage"] is None for c in body[:-1]) and all("kv_transfer" not in c for c in body)


def test_without_include_usage_there_is_no_usage_anywhere():
    stitcher = Stitcher(ROUTER_ID, 1, "m", chat=True, include_usage=False)
    chunks = run(stitcher, prefill_response("Hi"), [chat_chunk({}, "length"), usage_chunk(20, 2, 0)])
    assert all("usage" not in c for c in chunks[:-1]) and len(chunks) == 4  # role, Hi, finish, DONE


def tool_stream() -> list[dict]:
    header = {"index": 0, "id": "call_1", "type": "function",
              "function": {"name": "get_weather", "arguments": ""}}
    return [chat_chunk({"role": "assistant", "content": ""}),
            chat_chunk({"tool_calls": [header]}),
            chat_chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}),
            chat_chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}),
            chat_chunk({}, "tool_calls"), usage_chunk(30, 12, 0)]


def test_tool_call_deltas_survive_stitching_and_fold_into_the_body():
    stitcher = Stitcher(ROUTER_ID, 1, "m", chat=True, include_usage=False)
    # The first token opened the call: the prefill hop held it back (empty content).
    chunks = run(stitcher, prefill_response(""), tool_stream())
    deltas = [c["choices"][0]["delta"] for c in chunks[:-1]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert [d["tool_calls"][0] for d in deltas[1:4]] == [d["tool_calls"][0] for d in
                                                          (c["choices"][0]["delta"] for c in tool_stream()[1:4])]
    body = stitcher.body()
    message = body["choices"][0]["message"]
    assert message["content"] is None and body["choices"][0]["finish_reason"] == "tool_calls"
    assert message["tool_calls"] == [{"id": "call_1", "type": "function",
                                      "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]
    assert body["id"] == ROUTER_ID and body["object"] == "chat.completion"


def test_non_streamed_body_merges_content_logprobs_and_usage():
    lp = lambda t: {"content": [{"token": t, "logprob": -0.5, "bytes": list(t.encode()), "top_logprobs": []}],
                    "refusal": None}  # noqa: E731
    stitcher = Stitcher(ROUTER_ID, 5, "m", chat=True, include_usage=False)
    run(stitcher, prefill_response("A", logprobs=lp("A")),
        [chat_chunk({"content": "B"}, logprobs=lp("B")), chat_chunk({}, "length"), usage_chunk(20, 2, 0)])
    body = stitcher.body()
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "AB", "refusal": None}
    assert [e["token"] for e in body["choices"][0]["logprobs"]["content"]] == ["A", "B"]
    assert body["usage"]["prompt_tokens"] == 20 and body["usage"]["completion_tokens"] == 2
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 16


def test_completions_text_offsets_continue_after_the_first_token():
    def lp(tokens, offsets):
        return {"tokens": tokens, "token_logprobs": [-1.0] * len(tokens),
                "top_logprobs": [None] * len(tokens), "text_offset": offsets}
    first = {"choices": [{"index": 0, "text": "Once", "logprobs": lp(["Once"], [0]), "finish_reason": "length"}],
             "usage": {"prompt_tokens": 5, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 0}}}
    stitcher = Stitcher("cmpl-router", 1, "m", chat=False, include_usage=False)
    # The decode worker's offsets start at 0 after the first token.
    chunks = run(stitcher, first, [text_chunk(" upon", logprobs=lp([" upon"], [0])),
                                   text_chunk(" a", "length", logprobs=lp([" a"], [5]))], chat=False)
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == "Once upon a"
    assert stitcher.body()["choices"][0]["logprobs"]["text_offset"] == [0, 4, 9]
    assert all(c["object"] == "text_completion" and c["id"] == "cmpl-router" for c in chunks[:-1])


def test_resume_continues_content_without_repeating_it():
    stitcher = Stitcher(ROUTER_ID, 1, "m", chat=True, include_usage=True)
    sent = run(stitcher, prefill_response("The"), [chat_chunk({"content": " cat"}), chat_chunk({"content": " s"})])
    sent = [c for c in sent if c is not DONE and c["choices"]]
    # The decode endpoint died; a greedy re-run elsewhere starts from the first token again,
    # chunked differently.
    stitcher.resume()
    replay = [chat_chunk({"role": "assistant", "content": ""}), chat_chunk({"content": "The cat"}),
              chat_chunk({"content": " sat"}), chat_chunk({"content": "."}), chat_chunk({}, "stop"),
              usage_chunk(20, 4, 18)]
    rest = []
    for event in replay:
        rest += decode_parsed(stitcher.decode_event(event))
    assert content_of(sent) + content_of(rest) == "The cat sat."
    assert not any("role" in c["choices"][0]["delta"] for c in rest)
    assert content_of(rest) == "at."
    usage = decode_parsed(stitcher.done_chunks())[0]["usage"]
    assert usage["prompt_tokens"] == 20 and usage["completion_tokens"] == 4
    assert usage["prompt_tokens_details"]["cached_tokens"] == 16  # the client's prompt was cached there


def test_resume_inside_a_tool_call_sends_neither_the_header_nor_arguments_twice():
    stitcher = Stitcher(ROUTER_ID, 1, "m", chat=True, include_usage=False)
    stream = tool_stream()
    run(stitcher, prefill_response(""), stream[:3])  # header and '{"city": ' went out
    stitcher.resume()
    replay = [chat_chunk({"tool_calls": [{"index": 0, "id": "call_other", "type": "function",
                                          "function": {"name": "get_weather", "arguments": '{"ci'}}]}),
              chat_chunk({"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Paris"}'}}]}),
              chat_chunk({}, "tool_calls")]
    rest = []
    for event in replay:
        rest += decode_parsed(stitcher.decode_event(event))
    calls = [c["choices"][0]["delta"]["tool_calls"][0] for c in rest if c["choices"][0]["delta"].get("tool_calls")]
    assert calls == [{"index": 0, "function": {"arguments": '"Paris"}'}}]
    assert rest[-1]["choices"][0]["finish_reason"] == "tool_calls"
    call = stitcher.body()["choices"][0]["message"]["tool_calls"][0]
    assert call["id"] == "call_1" and call["function"]["arguments"] == '{"city": "Paris"}'


def test_local_route_stream_is_rewritten_not_reordered():
    """No prefill hop (monolithic or cached decode): the worker's stream, under the router's id."""
    stitcher = Stitcher(ROUTER_ID, 9, "m", chat=True, include_usage=True)
    chunks = run(stitcher, None, [chat_chunk({"role": "assistant", "content": ""}), chat_chunk({"content": "Hi"}),
                                  chat_chunk({}, "stop"), usage_chunk(40, 1, 32)])
    assert [c["choices"][0]["delta"] for c in chunks[:3]] == [{"role": "assistant", "content": ""},
                                                              {"content": "Hi"}, {}]
    assert chunks[3]["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
    assert {c["id"] for c in chunks[:-1]} == {ROUTER_ID}


def test_error_chunks_end_the_stream_cleanly():
    stitcher = Stitcher(ROUTER_ID, 1, "m", chat=True, include_usage=False)
    error, done = stitcher.error_chunks("the decode endpoint failed", code="decode_failed")
    assert json.loads(error[len("data: "):])["error"]["code"] == "decode_failed"
    assert done == "data: [DONE]\n\n"

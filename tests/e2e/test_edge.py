"""The HTTP edge of a worker and of the router under hostile or careless input: every bad body is
a 400/413 with the OpenAI error body (never a 500), CPU-heavy requests do not freeze the event
loop, a client that leaves a non-streamed request is a quiet 499, and /load hides what it should.
"""

from __future__ import annotations

import itertools
import json
import socket
import threading
import time

import httpx
import openai
import pytest

from tests.e2e.conftest import MODEL, wait_for
from tests.e2e.test_errors import CHAT, HELLO, assert_error, post

DEEP = b'{"model": "m", "messages": [{"role": "user", "content": "Hi"}], "x": ' + b"[" * 3000 \
    + b"]" * 3000 + b"}"
RAW_BODIES = {
    "nested_3000_deep": DEEP,
    "5000_digit_integer": b'{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": '
                          + b"7" * 5000 + b"}",
    "lone_surrogate": b'{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 2}',
    "nan_literal": b'{"messages": [{"role": "user", "content": "Hi"}], "temperature": NaN}',
    "infinite_float": b'{"messages": [{"role": "user", "content": "Hi"}], "temperature": 1e999}',
}


@pytest.mark.parametrize("name", RAW_BODIES)
def test_unusable_json_is_400_on_worker_and_router(server, edge_router, name):
    for target in (server, edge_router):
        assert_error(post(target, CHAT, None, raw=RAW_BODIES[name]), 400)
        assert_error(post(target, "/tokenize", None, raw=RAW_BODIES[name]), 400)


@pytest.mark.parametrize("key", ["special_tokens", "tools", "messages", "add_generation_prompt",
                                 "template", "self"])
def test_template_kwargs_that_collide_with_the_call_are_400(server, edge_router, key):
    body = {**HELLO, "chat_template_kwargs": {key: "x"}}
    for target in (server, edge_router):
        assert_error(post(target, CHAT, body), 400, param="chat_template_kwargs")


def test_template_kwargs_that_do_not_collide_still_work(client):
    response = client.chat.completions.create(model=MODEL, messages=HELLO["messages"], max_tokens=1,
                                              extra_body={"chat_template_kwargs": {"anything": 1}})
    assert response.choices[0].finish_reason == "length"


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"a": {"type": "string", "minLength": "two"}}},
    {"type": "object", "properties": {"a": {"type": "string", "maxLength": [1]}}},
])
def test_non_numeric_lengths_in_a_tool_schema_are_400(client, schema):
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=HELLO["messages"], tools=tools,
                                       tool_choice="required", max_tokens=4)
    assert info.value.param == "tools"


def test_non_ascii_bearer_token_is_401(server, edge_router):
    for target in (server, edge_router):
        headers = [("authorization", "Bearer clé-€".encode()), ("content-type", "application/json")]
        response = httpx.post(target.url + CHAT, content=json.dumps(HELLO).encode(), headers=headers)
        if target is server:
            assert_error(response, 401, code="invalid_api_key")
        else:  # the router has no client key: the header is ignored, the request goes through
            assert response.status_code == 200, response.text


FULL_BLOCKS = [1] * 40  # the router hashes full blocks (16 tokens) of the prompt to route it


@pytest.mark.parametrize("bad_id", [2**31, 2**40, -1, 49152])
def test_prompt_token_ids_outside_the_vocabulary_are_400(server, edge_router, bad_id):
    for target, prompt in itertools.product((server, edge_router),
                                            ([bad_id, *FULL_BLOCKS], [FULL_BLOCKS, [bad_id, *FULL_BLOCKS]])):
        assert_error(post(target, "/v1/completions", {"model": MODEL, "prompt": prompt,
                                                      "max_tokens": 2}), 400, param="prompt")


def test_max_completion_tokens_zero_is_400_and_one_is_honoured(client, server):
    body = {**HELLO, "max_tokens": 5, "max_completion_tokens": 0}
    assert_error(post(server, CHAT, body), 400, param="max_completion_tokens")
    response = client.chat.completions.create(model=MODEL, messages=HELLO["messages"], max_tokens=5,
                                              max_completion_tokens=1, temperature=0,
                                              extra_body={"ignore_eos": True})
    assert response.usage.completion_tokens == 1


def test_router_load_hides_worker_urls_without_a_key(edge_router, server):
    view = httpx.get(edge_router.url + "/load", timeout=10)
    assert view.status_code == 200
    assert server.url not in view.text and "127.0.0.1" not in view.text
    assert view.json()["endpoints"][0]["healthy"] is True


def chunked_request(url: str, path: str, headers: dict, chunks: list[bytes]) -> int:
    """POST a chunked body (no Content-Length) on a raw socket; the response status."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n" \
               f"Transfer-Encoding: chunked\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        sock.sendall(head.encode() + b"\r\n")
        try:
            for chunk in chunks:
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            sock.sendall(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed before the whole body was sent
        status_line = sock.makefile("rb").readline()
    return int(status_line.split()[1])


def test_chunked_body_over_the_limit_is_413_on_worker_and_router(server, edge_router):
    chunks = [b'{"prompt": "'] + [b"x" * 65536] * 24 + [b'"}']  # 1.5 MiB, over the 1 MiB limit
    for target in (server, edge_router):
        assert chunked_request(target.url, "/tokenize", target.headers(), chunks) == 413


def test_health_answers_while_a_large_body_is_tokenized(server):
    """Tokenizing ~0.9 MB takes the tokenizer a second or more; /health must keep answering
    meanwhile (before, the tokenizer held the event loop and /health waited for it)."""
    text = "hello world, this is text. " * 33000
    finished = threading.Event()
    answers_in_flight = []

    def tokenize() -> None:
        response = httpx.post(server.url + "/tokenize", json={"prompt": text},
                              headers=server.headers(), timeout=120)
        assert response.status_code == 200 and response.json()["count"] > 100_000
        finished.set()

    worker = threading.Thread(target=tokenize)
    worker.start()
    with httpx.Client(timeout=120) as client:
        while not finished.is_set():
            ok = client.get(server.url + "/health").status_code == 200
            if not finished.is_set():  # this answer came back while the tokenize was in flight
                answers_in_flight.append(ok)
            time.sleep(0.01)
    worker.join()
    assert len(answers_in_flight) >= 3 and all(answers_in_flight)


def test_disconnect_mid_non_streamed_request_is_a_quiet_499(server):
    server.wait_idle_and_whole()
    log_start = server.log_path.stat().st_size
    # Far more tokens than any machine of this kind decodes in the client's 1.5 s (a fast one
    # with suffix drafts ran 400 in under it, and the request finished before the hang-up).
    body = {**HELLO, "max_tokens": 4000, "temperature": 0, "ignore_eos": True}
    with httpx.Client(timeout=httpx.Timeout(60, read=1.5)) as client:
        with pytest.raises(httpx.ReadTimeout):  # the client gives up and hangs up
            client.post(server.url + CHAT, json=body, headers=server.headers())
    report = server.wait_idle_and_whole(timeout=60)
    assert report["num_requests_inflight"] == 0 and report["kv_pool_is_whole"] is True
    with open(server.log_path) as log:
        log.seek(log_start)
        written = log.read()
    assert "Traceback" not in written and "unhandled error" not in written


def test_client_that_leaves_while_sending_its_body_is_a_quiet_499(server, edge_router):
    """A client that promises 4,000 bytes, sends 20 and hangs up: the request ends as a 499 in
    the access log, with no traceback (it had been a 500 with two ERROR tracebacks)."""
    for target in (server, edge_router):
        log_start = target.log_path.stat().st_size
        host, port = target.url.removeprefix("http://").split(":")
        headers = "".join(f"{k}: {v}\r\n" for k, v in target.headers().items())
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall((f"POST {CHAT} HTTP/1.1\r\nHost: {host}\r\n{headers}"
                          "Content-Type: application/json\r\nContent-Length: 4000\r\n\r\n"
                          '{"messages": [').encode())

        def logged() -> str | None:
            with open(target.log_path) as log:
                log.seek(log_start)
                written = log.read()
            return written if f"POST {CHAT} 499" in written else None

        written = wait_for(logged, "the access line of the abandoned upload", target.log_path,
                           timeout=30)
        assert "Traceback" not in written and "unhandled error" not in written

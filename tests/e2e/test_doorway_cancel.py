"""A client that hangs up on a non-streamed request through the router stops it on the workers.

The router cancels the request's route when its client leaves before the response started
(hearth/api/middleware.py ReadGuard): the hops to the workers close, the decode worker aborts
the request and frees its KV blocks, as a worker does for a client of its own. Checked for each
API the router serves (chat, completions, Responses, Messages), monolithic and PD: the client
drops once the worker runs the request; the router logs the request as 499 (a route left to
finish would log 200), and the worker then runs nothing and holds a whole pool. Chat and
completions ask for `ignore_eos`, so their workers must also have generated far fewer tokens
than asked for (the other two APIs have no such field: their outputs may end early anyway).
"""

from __future__ import annotations

import json
import socket
import uuid
from urllib.parse import urlsplit

import pytest

from tests.e2e.conftest import MODEL, Server, start_router, start_servers, stop_all, wait_for

SECRET = "doorway-cancel-secret"
MAX_TOKENS = 2000  # tens of seconds of decoding here: the client leaves long before
COUNT = "Count from 1 to 5000, one number per line."  # for the APIs without ignore_eos
BODIES = {
    "/v1/chat/completions": {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0,
                             "ignore_eos": True, "messages": [{"role": "user", "content": "Hi"}]},
    "/v1/completions": {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0,
                        "ignore_eos": True, "prompt": "Once upon a time"},
    "/v1/responses": {"model": MODEL, "max_output_tokens": MAX_TOKENS, "temperature": 0,
                      "input": COUNT},
    "/v1/messages": {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0,
                     "messages": [{"role": "user", "content": COUNT}]},
}


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    """A prefill and a decode worker behind a router."""
    tmp = tmp_path_factory.mktemp("doorway-pd")
    flags = ("--num-kv-blocks", "256", "--kv-secret", SECRET)
    prefill, decode = start_servers(tmp, ("--role", "prefill", *flags), ("--role", "decode", *flags))
    try:
        router = start_router(tmp, "--prefill", prefill.url, "--decode", decode.url, "--model",
                              MODEL, "--min-disagg-tokens", "1")
    except BaseException:
        stop_all(prefill, decode)
        raise
    yield router, prefill, decode
    stop_all(router, prefill, decode)


def drop_while_running(router: Server, path: str, decode: Server) -> None:
    """Send the request on a raw socket, wait until `decode` runs it, then close the socket;
    then wait for the router's access-log line of the request, which must say 499."""
    body = json.dumps(BODIES[path]).encode()
    parts = urlsplit(router.url)
    request_id = f"doorway-{uuid.uuid4().hex}"
    request = (f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
               f"x-request-id: {request_id}\r\n"
               f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    with socket.create_connection((parts.hostname, parts.port), timeout=30) as sock:
        sock.sendall(request)
        wait_for(lambda: decode.load()["num_running"] >= 1, f"{path} running on the worker",
                 router.log_path, timeout=60)
    line = wait_for(lambda: next((line for line in router.log_path.read_text().splitlines()
                                  if f"id={request_id}" in line), None),
                    "the router's access-log line", router.log_path, timeout=60)
    assert f"POST {path} 499 " in line


def assert_stopped(worker: Server, generated_before: int, path: str | None = None) -> None:
    report = worker.wait_idle_and_whole(timeout=60)
    assert (report["num_requests_inflight"], report["num_running"], report["num_waiting"],
            report["kv_pool_is_whole"]) == (0, 0, 0, True)
    if path is not None and BODIES[path].get("ignore_eos"):
        assert report["num_generation_tokens"] - generated_before < MAX_TOKENS // 2


@pytest.mark.parametrize("path", list(BODIES))
def test_client_gone_stops_the_monolithic_worker(edge_router, server, path):
    generated_before = server.wait_idle_and_whole()["num_generation_tokens"]
    drop_while_running(edge_router, path, server)
    assert_stopped(server, generated_before, path)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_client_gone_stops_the_pd_hops(pd, path):
    router, prefill, decode = pd
    generated_before = decode.wait_idle_and_whole()["num_generation_tokens"]
    drop_while_running(router, path, decode)
    assert_stopped(decode, generated_before, path)
    assert_stopped(prefill, prefill.load()["num_generation_tokens"])

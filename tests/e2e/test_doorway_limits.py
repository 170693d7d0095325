"""The doorway holds slow and greedy clients to time and count limits (hearth/api/edge.py,
hearth/api/middleware.py), on a worker and on the router in front of it, over raw sockets:

  * a connection that sends nothing, or half its headers, is closed once `--header-timeout`
    has passed; a body that stops (short Content-Length, a chunked body with no last chunk)
    gets a 408 and a close once `--body-timeout` has passed; afterwards the server holds no
    connection more than before, and ordinary requests still work;
  * one address past `--max-connections-per-ip` gets a 429 and a close;
  * a burst of bodies at and past the body limit leaves the process's RSS within a bound (grown
    13 MiB on the worker, 23 on the router here; 31 and 44 without edge.bound_heap, the
    malloc_trim after big bodies and the chunk list).
"""

from __future__ import annotations

import json
import socket
from urllib.parse import urlsplit

import httpx
import psutil
import pytest

from tests.e2e.conftest import MODEL, Server, start_router, start_server, wait_for

TIMEOUTS = ("--header-timeout", "1", "--body-timeout", "1", "--keep-alive-timeout", "1")
MAX_CONNECTIONS = 6
# The raw sockets come from an address of their own, so the router's hops to the worker (from
# 127.0.0.1) count against neither the cap nor the connections the tests watch.
CLIENT_IP = "127.0.0.2"
WAIT = 20.0  # a bounded wait for what should take about a second
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def targets(tmp_path_factory) -> dict[str, Server]:
    tmp = tmp_path_factory.mktemp("doorway")
    flags = (*TIMEOUTS, "--max-connections-per-ip", str(MAX_CONNECTIONS), "--max-body-mb", "2")
    worker = start_server(tmp, *flags)
    try:
        router = start_router(tmp, "--worker", worker.url, *flags)
    except BaseException:
        worker.stop()
        raise
    yield {"worker": worker, "router": router}
    router.stop()
    worker.stop()


@pytest.fixture(params=["worker", "router"])
def target(request, targets) -> Server:
    return targets[request.param]


def address(server: Server) -> tuple[str, int]:
    parts = urlsplit(server.url)
    return parts.hostname, parts.port


def connect(server: Server, first: bytes = b"") -> socket.socket:
    sock = socket.create_connection(address(server), timeout=WAIT, source_address=(CLIENT_IP, 0))
    if first:
        sock.sendall(first)
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes (socket.timeout past WAIT: it never did)."""
    received = b""
    while True:
        try:
            data = sock.recv(65536)
        except ConnectionResetError:
            return received
        if not data:
            return received
        received += data


def open_connections(server: Server) -> int:
    """Sockets the server process holds open to CLIENT_IP on its listening port."""
    port = address(server)[1]
    return sum(1 for c in psutil.Process(server.process.pid).net_connections(kind="tcp")
               if c.laddr and c.laddr.port == port and c.raddr and c.raddr.ip == CLIENT_IP)


def head(path: str, *lines: str) -> bytes:
    return "\r\n".join([f"POST {path} HTTP/1.1", "Host: test", *lines, "", ""]).encode()


def test_stalled_connections_are_closed_and_normal_requests_still_work(target):
    assert open_connections(target) == 0
    chat = json.dumps({"model": MODEL, "max_tokens": 2,
                       "messages": [{"role": "user", "content": "Hi"}]}).encode()
    stalled = {
        "nothing sent": connect(target),
        "half a request line": connect(target, b"POST /v1/chat/comp"),
        "headers unfinished": connect(target, head(CHAT, "Content-Type: application/json")[:-2]),
        "short body": connect(target, head(CHAT, "Content-Type: application/json",
                                           f"Content-Length: {len(chat) + 10}") + chat),
        "chunked body stops": connect(target, head(CHAT, "Content-Type: application/json",
                                                   "Transfer-Encoding: chunked")
                                      + b"%x\r\n" % len(chat) + chat + b"\r\n"),
    }
    answers = {}
    for what, sock in stalled.items():
        with sock:
            answers[what] = read_until_closed(sock)
    # no request: closed without a word; a request whose body stopped: a 408 and a close
    assert {what: answer.split(b"\r\n")[0] for what, answer in answers.items()} == {
        "nothing sent": b"", "half a request line": b"", "headers unfinished": b"",
        "short body": b"HTTP/1.1 408 Request Timeout",
        "chunked body stops": b"HTTP/1.1 408 Request Timeout"}
    error = json.loads(answers["short body"].split(b"\r\n\r\n", 1)[1])["error"]
    assert error["code"] == "request_timeout"
    wait_for(lambda: open_connections(target) == 0, "every stalled connection closed",
             target.log_path, timeout=WAIT)
    with httpx.Client(timeout=60) as client:  # two requests on one kept-alive connection
        for _ in range(2):
            response = client.post(target.url + CHAT, json=json.loads(chat))
            assert response.status_code == 200, response.text


def test_connections_past_the_cap_get_429(target):
    held = [connect(target) for _ in range(MAX_CONNECTIONS)]
    try:
        # accepted after the held ones, so counted after them whatever the timing
        with connect(target, b"GET /v1/models HTTP/1.1\r\nHost: test\r\n\r\n") as extra:
            answer = read_until_closed(extra)
    finally:
        for sock in held:
            sock.close()
    status, body = answer.split(b"\r\n", 1)[0], answer.split(b"\r\n\r\n", 1)[1]
    assert status == b"HTTP/1.1 429 Too Many Requests"
    assert json.loads(body)["error"]["code"] == "too_many_connections"
    wait_for(lambda: httpx.get(target.url + "/v1/models", timeout=10).status_code == 200,
             "a request once the held connections are gone", target.log_path, timeout=WAIT)


def burst(server: Server, limit: int, count: int) -> set[int]:
    """`count` bodies at and past `limit` (valid but too long a prompt, millions of numbers,
    malformed, declared too big, chunked too big); the statuses they got."""
    text = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": ""}]})
    under = text.replace('"content": ""', '"content": "' + "x" * (limit - len(text) - 16) + '"')
    kinds = [under.encode(), b"[" + b"1," * ((limit - 16) // 2) + b"1]",
             b'{"model": "' + b"y" * (limit - 64), b"z" * (limit + 1024), None]
    over = kinds[3]
    statuses = set()
    with httpx.Client(timeout=60) as client:
        for i in range(count):
            content = kinds[i % len(kinds)]
            if content is None:  # chunked
                content = (over[j:j + 2**18] for j in range(0, len(over), 2**18))
            try:
                statuses.add(client.post(server.url + CHAT, content=content).status_code)
            except httpx.HTTPError:
                statuses.add(-1)  # the server answered 413 and closed while the body went out
    return statuses


def test_a_burst_of_huge_bodies_leaves_memory_bounded(target):
    process = psutil.Process(target.process.pid)
    burst(target, 2 * 2**20, 10)  # the first buffers of each kind are part of the baseline
    before = process.memory_info().rss
    statuses = burst(target, 2 * 2**20, 100)
    grown_mib = (process.memory_info().rss - before) / 2**20
    assert statuses <= {400, 413, -1}, statuses
    assert grown_mib < 35, f"RSS grew {grown_mib:.0f} MiB over 100 bodies of ~2 MiB"

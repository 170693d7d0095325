"""What every HTTP edge (worker and router) does around its routes: CORS, the access log, and the
doorway's guard on reading (a body timeout, a client that leaves before its answer).

CORS is off unless origins are given (`--allowed-origins`): then a browser's preflight
`OPTIONS` is answered (before auth: preflights carry no credentials) and responses to those
origins carry `Access-Control-Allow-Origin`.

The access log writes one line per request once its response has ended (a stream: when its last
byte went out, or the client left), on the `hearth.access` logger:

    POST /v1/chat/completions 200 412.3ms id=5f0c...

The request id is the client's `x-request-id` if it sent one, else a fresh one; it is put in the
request's headers (so the router forwards it to the workers, whose lines then carry the same id)
and echoed in the response's `x-request-id`. The polls of load balancers and monitors
(/health, /load, /metrics) are logged at DEBUG, everything else at INFO.

`ReadGuard` bounds each read of a request body: no byte for `body_timeout` seconds is a 408
`request_timeout` (OpenAI-shaped, raised where the route reads its body) and the connection is
closed after it. With `cancel_on_disconnect` (the router) it also watches, once the body is
read, for the client to hang up before the response started (a non-streamed request still being
generated) and cancels the route then: its hops to the workers close, so each worker aborts the
request and frees its KV blocks, as it would for a client of its own. Streamed responses are left
to Starlette, which stops a stream whose client left and then runs its cleanup.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

from hearth.api.edge import release_heap
from hearth.api.protocol import APIError

access_log = logging.getLogger("hearth.access")

POLL_PATHS = frozenset({"/health", "/load", "/metrics"})
REQUEST_ID = b"x-request-id"
MAX_REQUEST_ID_CHARS = 128  # a longer client id is replaced (it goes into every log line)
TRIM_AFTER_BYTES = 2**20  # after a body this big, the heap's free pages go back to the system


def install_edge_middleware(app: FastAPI, allowed_origins: tuple[str, ...], log_requests: bool,
                            body_timeout: float = 30.0, cancel_on_disconnect: bool = False) -> None:
    """The read guard innermost, CORS for `allowed_origins` ("*" for any; () for none), then the
    access log outermost (so a preflight and a CORS refusal are logged too)."""
    app.add_middleware(ReadGuard, body_timeout=body_timeout,
                       cancel_on_disconnect=cancel_on_disconnect)
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins),
                           allow_methods=["*"], allow_headers=["*"],
                           expose_headers=["x-request-id"])
    app.add_middleware(AccessLog, enabled=log_requests)


class AccessLog:
    """Pure ASGI middleware (a BaseHTTPMiddleware would buffer streamed responses)."""

    def __init__(self, app, enabled: bool = True) -> None:
        self.app = app
        self.enabled = enabled

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = _request_id(scope)
        status = 500  # if the app fails before it starts a response

        async def send_with_id(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", ()),
                                                  (REQUEST_ID, request_id.encode())]}
            await send(message)

        start = time.perf_counter()
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            if self.enabled:
                level = logging.DEBUG if scope["path"] in POLL_PATHS else logging.INFO
                access_log.log(level, "%s %s %d %.1fms id=%s", scope["method"], scope["path"],
                               status, (time.perf_counter() - start) * 1000, request_id)


def _request_id(scope) -> str:
    """The client's x-request-id (if short and printable) or a new one, set in the headers."""
    headers = scope.get("headers") or []
    for name, value in headers:
        if name == REQUEST_ID:
            text = value.decode("latin-1")
            if 0 < len(text) <= MAX_REQUEST_ID_CHARS and text.isprintable():
                return text
            break
    request_id = uuid.uuid4().hex
    scope["headers"] = [(n, v) for n, v in headers if n != REQUEST_ID] + [
        (REQUEST_ID, request_id.encode())]
    return request_id


def request_timeout(seconds: float) -> APIError:
    return APIError(408, f"no byte of the request body arrived for {seconds:g}s",
                    code="request_timeout")


class ReadGuard:
    """Pure ASGI middleware: a timeout per body read, and (optionally) the route cancelled when
    its client leaves before the response starts. See the module docstring."""

    def __init__(self, app, body_timeout: float, cancel_on_disconnect: bool = False) -> None:
        self.app = app
        self.body_timeout = body_timeout
        self.cancel_on_disconnect = cancel_on_disconnect

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        exchange = _Exchange(self, receive, send)
        route = asyncio.ensure_future(self.app(scope, exchange.receive, exchange.send))
        exchange.route = route
        try:
            await route  # cancelled with this task (server shutdown) as well
        except asyncio.CancelledError:
            if not exchange.client_left or asyncio.current_task().cancelling():
                raise
            # Nobody reads the answer: the status is for the access log (uvicorn drops sends
            # to a closed connection).
            await send({"type": "http.response.start", "status": 499, "headers": []})
            await send({"type": "http.response.body", "body": b""})
        finally:
            exchange.stop_watching()
        if exchange.num_body_bytes > TRIM_AFTER_BYTES:
            await asyncio.to_thread(release_heap)


class _Exchange:
    """One request's receive/send as the route sees them (ReadGuard)."""

    def __init__(self, guard: ReadGuard, receive, send) -> None:
        self.guard, self._receive, self._send = guard, receive, send
        self.route: asyncio.Future | None = None
        self.num_body_bytes = 0
        self.body_done = False
        self.timed_out = False
        self.response_started = False
        self.client_left = False
        self.watcher: asyncio.Task | None = None  # owns the connection's receive once the body is read

    async def receive(self):
        if self.watcher is not None:
            if self.watcher.done():  # without suspending: Starlette's is_disconnected() needs that
                return self.watcher.result()
            return await asyncio.shield(self.watcher)
        if self.body_done:
            return await self._receive()
        try:
            async with asyncio.timeout(self.guard.body_timeout):
                message = await self._receive()
        except TimeoutError:
            self.timed_out = True
            raise request_timeout(self.guard.body_timeout) from None
        if message["type"] == "http.request":
            self.num_body_bytes += len(message.get("body", b""))
        if message["type"] != "http.request" or not message.get("more_body", False):
            self.body_done = True
            if self.guard.cancel_on_disconnect and message["type"] == "http.request":
                self.watcher = asyncio.ensure_future(self._watch())
        return message

    async def _watch(self):
        # After the body, the server's receive answers only once the client left or the
        # response completed: either way an http.disconnect.
        message = await self._receive()
        if message["type"] == "http.disconnect" and not self.response_started:
            self.client_left = True
            if self.route is not None:
                self.route.cancel()
        return message

    async def send(self, message) -> None:
        if message["type"] == "http.response.start":
            self.response_started = True
            if self.timed_out:  # the rest of a stalled body is never read: close, do not wait
                message = {**message, "headers": [*message.get("headers", ()),
                                                  (b"connection", b"close")]}
        await self._send(message)

    def stop_watching(self) -> None:
        if self.watcher is not None and not self.watcher.done():
            self.watcher.cancel()

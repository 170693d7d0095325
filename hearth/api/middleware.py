"""What every HTTP edge (worker and router) does around its routes: CORS and the access log.

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
"""

from __future__ import annotations

import logging
import time
import uuid

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

access_log = logging.getLogger("hearth.access")

POLL_PATHS = frozenset({"/health", "/load", "/metrics"})
REQUEST_ID = b"x-request-id"
MAX_REQUEST_ID_CHARS = 128  # a longer client id is replaced (it goes into every log line)


def install_edge_middleware(app: FastAPI, allowed_origins: tuple[str, ...],
                            log_requests: bool) -> None:
    """CORS for `allowed_origins` ("*" for any; () for none), then the access log outermost
    (so a preflight and a CORS refusal are logged too)."""
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

"""What the HTTP edge of a worker and of the router does before a request reaches a handler:
hold connections to time and count limits, read a bounded body, decode it as bounded JSON, check
a bearer key, and run CPU work off the event loop.

Invariants:
  * no connection is held by a client that stalls (`DoorwayConfig`): a request's headers must
    be complete within `header_timeout_seconds` of its first byte (of the connection, for a first
    request), else the socket is closed; an idle kept-alive connection closes after
    `keep_alive_seconds`; a body that sends no byte for `body_timeout_seconds` gets a 408 and
    the connection is closed (hearth/api/middleware.py); one client address holds at most
    `max_connections_per_ip` connections, a request on one more gets a 429 and a close;
  * a body is never held past `limit` bytes: a larger Content-Length is refused before the first
    byte is read, and a chunked body is counted as it streams in (413 either way);
  * a decoded body is plain JSON that every later step can walk and encode: no NaN/Infinity,
    no integer literal past Python's digit limit, no nesting deeper than MAX_JSON_DEPTH, no lone
    UTF-16 surrogate in any string (each of these is a 400, never a 500 further in);
  * CPU-heavy work (JSON decoding, chat rendering, tokenization) runs on a small bounded thread
    pool (`CpuPool`), so /health and streams keep flowing while a large request is worked on.
"""

from __future__ import annotations

import asyncio
import ctypes
import hmac
import json
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from starlette.requests import Request

from hearth.api.protocol import APIError, bad_request

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffers a stream
MAX_JSON_DEPTH = 64  # arrays/objects inside each other; OpenAI's own schema limits are far lower
MAX_CONTENT_LENGTH_DIGITS = 19  # a Content-Length header longer than this is past any limit

T = TypeVar("T")
log = logging.getLogger("hearth.edge")


@dataclass(frozen=True)
class DoorwayConfig:
    """How long a client may take and how many connections it may hold (worker and router)."""

    header_timeout_seconds: float = 10.0  # a request line + headers complete within this
    body_timeout_seconds: float = 30.0  # no byte of a body for this long: 408, connection closed
    keep_alive_seconds: float = 5.0  # an idle connection between requests is closed after this
    max_connections_per_ip: int = 256  # open connections from one client address; 0: no cap


def uvicorn_config(app: Any, host: str, port: int, log_level: str, doorway: DoorwayConfig):
    """uvicorn's Config for a hearth HTTP process, connections held to `doorway`."""
    import uvicorn

    return uvicorn.Config(app, host=host, port=port, log_level=log_level.lower(), access_log=False,
                          log_config=None, timeout_graceful_shutdown=5,
                          timeout_keep_alive=doorway.keep_alive_seconds,  # type: ignore[arg-type]
                          http=doorway_protocol(doorway))


def doorway_protocol(doorway: DoorwayConfig) -> type:
    """uvicorn's h11 protocol plus a deadline on each request's headers and a per-address cap.

    uvicorn times out only idle kept-alive connections: a client that sends nothing, or half a
    request line, holds its socket forever. Here a timer runs while h11 waits for a request's
    headers (from the connection's start, and from the first byte of each later request) and
    closes the socket when it fires; a trickle of bytes does not extend it. The count of open
    connections per address is this server's own (one class per server)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    open_per_address: dict[str, int] = {}

    class DoorwayProtocol(H11Protocol):
        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self.head_timer: asyncio.TimerHandle | None = None
            self.address = self.client[0] if self.client else ""
            count = open_per_address.get(self.address, 0) + 1
            open_per_address[self.address] = count
            if 0 < doorway.max_connections_per_ip < count:
                log.debug("%s holds %d connections: refusing one", self.address, count)
                self.app = too_many_connections  # its request gets a 429 and a close
            self.head_timer = self.loop.call_later(doorway.header_timeout_seconds, self.head_late)

        def connection_lost(self, exc: Exception | None) -> None:
            self.cancel_head_timer()
            count = open_per_address.pop(self.address, 1) - 1
            if count > 0:
                open_per_address[self.address] = count
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self.watch_head(started=True)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self.watch_head(started=bool(self.conn.trailing_data[0]))  # a pipelined request

        def watch_head(self, started: bool) -> None:
            """The timer runs while a request has begun but its headers are not complete."""
            if self.conn.their_state is not h11.IDLE or self.transport.is_closing():
                self.cancel_head_timer()
            elif started and self.head_timer is None:
                self.head_timer = self.loop.call_later(doorway.header_timeout_seconds,
                                                       self.head_late)

        def cancel_head_timer(self) -> None:
            if self.head_timer is not None:
                self.head_timer.cancel()
                self.head_timer = None

        def head_late(self) -> None:
            self.head_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                log.debug("closing a connection from %s: no complete request headers within %gs",
                          self.address, doorway.header_timeout_seconds)
                self.transport.close()

    return DoorwayProtocol


async def too_many_connections(scope, receive, send) -> None:
    """The raw ASGI answer to a request on a connection past its address's cap."""
    body = json.dumps(APIError(429, "too many open connections from this address",
                               code="too_many_connections").body()).encode()
    await send({"type": "http.response.start", "status": 429, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


def bound_heap() -> None:
    """glibc's allocator, set so that a burst of big bodies does not stay in the process: every
    allocation past 256 KiB is its own mapping, given back on free (a fixed threshold also
    stops glibc raising it after each freed big buffer, which is what let 32 MiB bodies land in
    the heap for good), and two arenas instead of eight per core for the edge's threads. No-op
    off glibc."""
    libc = _glibc()
    if libc is not None:
        libc.mallopt(-3, 256 * 1024)  # M_MMAP_THRESHOLD
        libc.mallopt(-8, 2)  # M_ARENA_MAX


def release_heap() -> None:
    """Give the heap's free pages back to the system (after a big body was decoded: its
    millions of small objects leave freed but mapped pages in the arenas)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def _glibc() -> Any:
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


class CpuPool:
    """A small thread pool for the edge's CPU work; bounded, so a burst of huge requests queues
    here instead of starving the event loop. The Rust tokenizer and Jinja release the GIL often
    enough (see Tokenizer.encode) for the loop to keep answering meanwhile."""

    def __init__(self, num_threads: int = 2) -> None:
        self._executor = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="edge-cpu")

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def body_too_large(limit: int) -> APIError:
    return APIError(413, f"request body exceeds {limit} bytes", code="body_too_large")


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body, refusing (413) past `limit` bytes without reading further."""
    declared = (request.headers.get("content-length") or "").strip()
    if declared.isdigit() and (len(declared) > MAX_CONTENT_LENGTH_DIGITS or int(declared) > limit):
        raise body_too_large(limit)
    chunks: list[bytes] = []  # joined once: no growing buffer reallocated along the way
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise body_too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"number {text[:40]} is out of range")
    return value


def decode_json(body: bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Bytes -> checked JSON value; every way the bytes can be unusable is a 400."""
    try:
        value = json.loads(body, parse_constant=_reject_constant, parse_float=_finite_float)
    except RecursionError:
        raise bad_request(f"request body is nested deeper than {max_depth} levels") from None
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError; so is
        # "Exceeds the limit (4300 digits) for integer string conversion"
        raise bad_request(f"request body is not valid JSON: {exc}") from None
    check_json_value(value, max_depth)
    return value


def check_json_value(value: Any, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Depth and string checks over a decoded value, iteratively (no recursion to run out of)."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, str):
            _check_text(node)
        elif isinstance(node, (dict, list)):
            if depth >= max_depth:
                raise bad_request(f"request body is nested deeper than {max_depth} levels")
            if isinstance(node, dict):
                for key, item in node.items():
                    _check_text(key)
                    stack.append((item, depth + 1))
            else:
                stack.extend((item, depth + 1) for item in node)


def _check_text(text: str) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request("request body contains a lone UTF-16 surrogate (\\ud800-\\udfff escape), "
                          "which is not text") from None


async def read_json(request: Request, limit: int, pool: CpuPool) -> Any:
    """The body as checked JSON (see `decode_json`), decoded off the event loop."""
    body = await read_body(request, limit)
    return await pool.run(decode_json, body)


def longest_token_chars(tokenizer: Any) -> int:
    """Characters of the vocabulary's longest token (its surface form, an upper bound on the
    text one token covers): a text longer than 2 x this x the context cannot fit, whatever its
    tokens (x2 leaves room for normalisation), so it is refused before it is tokenized."""
    return max(len(tokenizer.id_to_token(i) or "") for i in range(tokenizer.vocab_size)) or 1


def bearer_matches(authorization: str, key: str) -> bool:
    """Whether an Authorization header carries `Bearer <key>`, compared in constant time over
    bytes (the header as sent, latin-1 per HTTP; the key as UTF-8), so any header is a 401 or
    a pass, never an error."""
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return False
    sent = token.strip().encode("latin-1", errors="replace")
    return hmac.compare_digest(sent, key.encode("utf-8"))


def unauthorized() -> APIError:
    return APIError(401, "missing or invalid API key (Authorization: Bearer <key>)",
                    "authentication_error", code="invalid_api_key")


def check_api_key(headers: Any, key: str | None) -> None:
    """The 401 of a request without the key (`key` None: no key is required)."""
    if key is not None and not api_key_matches(headers, key):
        raise unauthorized()


def api_key_matches(headers: Any, key: str) -> bool:
    """`Authorization: Bearer <key>` (OpenAI clients) or `x-api-key: <key>` (Anthropic clients)."""
    if bearer_matches(headers.get("authorization", ""), key):
        return True
    sent = headers.get("x-api-key", "").strip().encode("latin-1", errors="replace")
    return hmac.compare_digest(sent, key.encode("utf-8"))

"""What the HTTP edge of a worker and of the router does before a request reaches a handler:
read a bounded body, decode it as bounded JSON, check a bearer key, and run CPU work off the
event loop.

Invariants:
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
import hmac
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

from starlette.requests import Request

from hearth.api.protocol import APIError, bad_request

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffers a stream
MAX_JSON_DEPTH = 64  # arrays/objects inside each other; OpenAI's own schema limits are far lower
MAX_CONTENT_LENGTH_DIGITS = 19  # a Content-Length header longer than this is past any limit

T = TypeVar("T")


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
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise body_too_large(limit)
    return bytes(body)


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

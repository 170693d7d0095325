"""HTTP hops from the router to one worker, and how their failures are classified.

Two kinds of failure, because they call for different actions:
  * `HopError`: the endpoint failed (cannot connect, 5xx, 429/503 at capacity, a broken or
    stalled stream, an error event mid-stream). Another endpoint may succeed: retry there.
  * `WorkerRejected`: the worker answered 4xx about the request itself (bad field, context too
    long). Every endpoint would say the same: the client gets that exact error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, AsyncIterator

import httpx

from hearth.router.stitch import DONE, parse_sse_data

# Statuses that say "this endpoint, now" rather than "this request": try another endpoint.
RETRYABLE_STATUSES = {429, 502, 503, 504}


class HopError(Exception):
    def __init__(self, endpoint: str, message: str, eject: bool = True) -> None:
        super().__init__(f"{endpoint}: {message}")
        self.endpoint = endpoint
        self.eject = eject  # False for "at capacity": the endpoint is healthy, only busy


class WorkerRejected(Exception):
    def __init__(self, status: int, body: dict) -> None:
        super().__init__(f"worker answered {status}")
        self.status, self.body = status, body


@dataclass(frozen=True)
class HopTimeouts:
    connect: float = 5.0  # a worker that cannot accept a connection this fast is ejected
    request: float = 600.0  # a whole prefill hop (long prompts queue behind others on a CPU)
    stream_idle: float = 120.0  # no byte of a decode stream for this long: treated as dead


def _error_body(response: httpx.Response, text: bytes) -> dict:
    try:
        body = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError):
        body = None
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return body
    message = text.decode(errors="replace")[:500] or response.reason_phrase
    return {"error": {"message": message, "type": "internal_server_error", "param": None,
                      "code": None}}


def _check_status(endpoint: str, response: httpx.Response, text: bytes) -> None:
    if response.status_code < 400:
        return
    body = _error_body(response, text)
    if response.status_code in RETRYABLE_STATUSES or response.status_code >= 500:
        raise HopError(endpoint, f"HTTP {response.status_code}: {body['error'].get('message')}",
                       eject=response.status_code >= 500 and response.status_code != 503)
    raise WorkerRejected(response.status_code, body)


async def post_json(client: httpx.AsyncClient, endpoint: str, path: str, body: dict,
                    headers: dict[str, str], timeouts: HopTimeouts) -> dict:
    try:
        response = await client.post(endpoint + path, json=body, headers=headers,
                                     timeout=httpx.Timeout(timeouts.request, connect=timeouts.connect))
    except httpx.HTTPError as exc:
        raise HopError(endpoint, f"{type(exc).__name__}: {exc}") from None
    _check_status(endpoint, response, response.content)
    try:
        return response.json()
    except json.JSONDecodeError:
        raise HopError(endpoint, "the response is not JSON") from None


class Stream:
    """An open SSE response of one hop; `events()` yields parsed chunks until [DONE]."""

    def __init__(self, endpoint: str, response: httpx.Response) -> None:
        self.endpoint, self.response = endpoint, response

    async def events(self) -> AsyncIterator[dict]:
        """Chunks as dicts. Raises HopError if the stream breaks, stalls, carries an error
        event, or ends without [DONE]: the remainder is then owed by another endpoint."""
        try:
            async for line in self.response.aiter_lines():
                event = parse_sse_data(line)
                if event is DONE:
                    return
                if event is None:
                    continue
                if isinstance(event, dict) and "error" in event and "choices" not in event:
                    message = (event["error"] or {}).get("message", "error event")
                    raise HopError(self.endpoint, f"error event: {message}", eject=False)
                yield event
        except httpx.HTTPError as exc:
            raise HopError(self.endpoint, f"stream broke: {type(exc).__name__}: {exc}") from None
        except json.JSONDecodeError:
            raise HopError(self.endpoint, "stream carried malformed JSON") from None
        raise HopError(self.endpoint, "stream ended without [DONE]")

    async def close(self) -> None:
        await self.response.aclose()


async def open_stream(client: httpx.AsyncClient, endpoint: str, path: str, body: dict,
                      headers: dict[str, str], timeouts: HopTimeouts) -> Stream:
    timeout = httpx.Timeout(timeouts.stream_idle, connect=timeouts.connect)
    request = client.build_request("POST", endpoint + path, json=body, headers=headers,
                                   timeout=timeout)
    try:
        response = await client.send(request, stream=True)
    except httpx.HTTPError as exc:
        raise HopError(endpoint, f"{type(exc).__name__}: {exc}") from None
    if response.status_code >= 400:
        try:
            text = await response.aread()
        except httpx.HTTPError:
            text = b""
        finally:
            await response.aclose()
        _check_status(endpoint, response, text)
    return Stream(endpoint, response)


def forward_headers(incoming: Any, api_key: str | None) -> dict[str, str]:
    """Headers a hop carries: the worker's key (if any), the session hint and the request id."""
    headers = {}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    for name in ("x-session-affinity", "x-request-id"):  # the request id: one id in every log
        value = incoming.get(name)
        if value:
            headers[name] = value
    return headers

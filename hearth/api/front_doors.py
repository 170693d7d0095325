"""The Responses and Messages front doors: API request -> internal chat request -> ChatEvents ->
API response, over a `ChatBackend` that runs the chat request.

    worker:  ChatBackend = parse the chat body, `serving_chat.chat_events` (engine + tool parser)
    router:  ChatBackend = the router's own chat pipeline (routing, PD hops, stitching), read
             back with `ChatChunkReader` (hearth/router/router_front_doors.py)

So a front door never sees the engine, a tool parser, a grammar or a PD hop: both the worker and
the router run exactly the code below, and a chat feature (a parser, a guided-decoding mode, a
stitching fix) reaches every API at once. Anything wrong with a request raises an APIError before
the first byte (the backend plans and admits it before it returns its stream).
"""

from __future__ import annotations

import time
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from hearth.api.chat_output import ChatEvents, Failed
from hearth.api.edge import SSE_HEADERS
from hearth.api.messages_api import (CountTokensRequest, MessagesRequest, to_chat_body as
                                        messages_chat_body, to_tokenize_body)
from hearth.api.messages_writer import MessageWriter
from hearth.api.protocol import APIError, new_id, parse_request
from hearth.api.responses_api import (ResponsesRequest, ResponseStore, StoredResponse, history_for,
                                         input_items, request_echo, to_chat_body as responses_chat_body)
from hearth.api.responses_writer import ResponseWriter

ChatBackend = Callable[[dict[str, Any]], Awaitable[ChatEvents]]
CountTokens = Callable[[dict[str, Any]], Awaitable[int]]  # a /tokenize body -> its token count



class EventStream:
    """A streamed response's SSE strings; `aclose()` also closes its ChatEvents, so a client gone
    before the first chunk still frees the engine requests (or the router's ticket)."""

    def __init__(self, writer: ResponseWriter | MessageWriter, events: ChatEvents,
                 on_end: Callable[[], None] = lambda: None) -> None:
        self.events = events
        self._chunks = _write(writer, events, on_end)

    def __aiter__(self) -> AsyncIterator[str]:
        return self._chunks

    async def aclose(self) -> None:
        try:
            await self._chunks.aclose()
        finally:
            await self.events.aclose()


async def _fold(writer: ResponseWriter | MessageWriter, events: ChatEvents) -> None:
    """Feed a non-streamed response's whole output; a failure is a 500."""
    try:
        async for event in events:
            writer.feed(event)
            if isinstance(event, Failed):
                raise APIError(500, event.message, "internal_server_error")
    finally:
        await events.aclose()


async def _write(writer: ResponseWriter | MessageWriter, events: ChatEvents,
                 on_end: Callable[[], None] = lambda: None) -> AsyncIterator[str]:
    try:
        for chunk in writer.start():
            yield chunk
        async for event in events:
            for chunk in writer.feed(event):
                yield chunk
        on_end()
    finally:
        await events.aclose()


# ---- Responses -----------------------------------------------------------------------------------


async def create_response(raw: Any, backend: ChatBackend, store: ResponseStore,
                          model_name: str) -> dict | EventStream:
    request = parse_request(ResponsesRequest, raw)
    history = history_for(store, request)
    events = await backend(responses_chat_body(request, history))
    writer = ResponseWriter(new_id("resp").replace("-", "_"), model_name, int(time.time()),
                            request_echo(request))

    def remember() -> None:
        if request.store and writer.status in ("completed", "incomplete"):
            items = history + input_items(request) + writer.body()["output"]
            store.put(writer.response_id, StoredResponse(writer.body(), items))

    if request.stream:
        return EventStream(writer, events, remember)
    await _fold(writer, events)
    remember()
    return writer.body()


# ---- Messages ------------------------------------------------------------------------------------


async def create_message(raw: Any, backend: ChatBackend, model_name: str) -> dict | EventStream:
    request = parse_request(MessagesRequest, raw)
    events = await backend(messages_chat_body(request))
    writer = MessageWriter(new_id("msg").replace("-", "_"), model_name)
    if request.stream:
        return EventStream(writer, events)
    await _fold(writer, events)
    return writer.body()


async def count_message_tokens(raw: Any, count: CountTokens) -> dict:
    request = parse_request(CountTokensRequest, raw)
    return {"input_tokens": await count(to_tokenize_body(request))}


def respond(result: dict | EventStream) -> Response:
    if isinstance(result, dict):
        return JSONResponse(result)
    return StreamingResponse(result, media_type="text/event-stream", headers=SSE_HEADERS,
                             background=BackgroundTask(result.aclose))

"""The Responses and Messages front doors: API request -> internal chat request -> ChatEvents ->
API response, over a `ChatBackend` that runs the chat request.

    worker:  ChatBackend = parse the chat body, `serving_chat.chat_events` (engine + tool parser)
    router:  ChatBackend = the router's own chat pipeline (routing, PD hops, stitching), read
             back with `ChatChunkReader` (hearth/router/front_doors.py)

So a front door never sees the engine, a tool parser, a grammar or a PD hop: both the worker and
the router run exactly the code below, and a chat feature (a parser, a guided-decoding mode, a
stitching fix) reaches every API at once. Anything wrong with a request raises an APIError before
the first byte (the backend plans and admits it before it returns its stream).
"""

from __future__ import annotations

import time
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from hearth.server.chat import render_chat_prompt
from hearth.server.chat_output import ChatEvents, Failed
from hearth.server.edge import SSE_HEADERS, read_json
from hearth.server.messages_api import (CountTokensRequest, MessagesRequest, to_chat_body as
                                        messages_chat_body, to_tokenize_body)
from hearth.server.messages_writer import MessageWriter
from hearth.server.protocol import APIError, ChatCompletionRequest, TokenizeRequest, parse_request
from hearth.server.responses_api import (ResponsesRequest, ResponseStore, StoredResponse, history_for,
                                         input_items, request_echo, to_chat_body as responses_chat_body)
from hearth.server.responses_writer import ResponseWriter
from hearth.server.serving import ServerState, check_model, check_prompt_chars, new_id
from hearth.server.serving_chat import chat_events

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


# ---- on a worker ---------------------------------------------------------------------------------


def worker_backend(state: ServerState, request: Request) -> ChatBackend:
    async def run(body: dict[str, Any]) -> ChatEvents:
        chat_request = parse_request(ChatCompletionRequest, body)
        return await chat_events(state, chat_request, None if chat_request.stream
                                 else request.is_disconnected)

    return run


def _count_tokens(state: ServerState, body: TokenizeRequest) -> int:
    """(on the CPU pool) The prompt's token count, rendered as a chat request renders it."""
    text = render_chat_prompt(state.tokenizer, body.messages or [], body.tools, True)
    check_prompt_chars(state, text, "messages")
    return len(state.tokenizer.encode(text))


def front_door_routes(worker: Any) -> APIRouter:
    """POST /v1/responses, GET /v1/responses/{id}, POST /v1/messages, /v1/messages/count_tokens
    on a worker (`worker`: hearth.server.app.Worker)."""
    router = APIRouter()
    limit = worker.config.max_body_bytes

    @router.post("/v1/responses")
    async def responses(request: Request) -> Response:
        state = worker.ready_state()
        raw = await read_json(request, limit, worker.cpu)
        return respond(await create_response(raw, worker_backend(state, request),
                                             worker.response_store, state.model_name))

    @router.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> dict:
        return worker.response_store.get(response_id).body

    @router.post("/v1/messages")
    async def messages(request: Request) -> Response:
        state = worker.ready_state()
        raw = await read_json(request, limit, worker.cpu)
        return respond(await create_message(raw, worker_backend(state, request), state.model_name))

    @router.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> dict:
        state = worker.ready_state()
        raw = await read_json(request, limit, worker.cpu)

        async def count(body: dict[str, Any]) -> int:
            tokenize = parse_request(TokenizeRequest, body)
            return await state.cpu.run(_count_tokens, state, tokenize)

        if isinstance(raw, dict):
            check_model(state, raw.get("model") if isinstance(raw.get("model"), str) else None)
        return await count_message_tokens(raw, count)

    return router

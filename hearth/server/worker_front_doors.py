"""The Responses and Messages front doors on a worker: the shared doors (hearth/api/front_doors.py)
over a `ChatBackend` that parses the chat body and runs `serving_chat.chat_events` (engine + tool
parser). The router's backend is hearth/router/router_front_doors.py.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from hearth.api.front_doors import (ChatBackend, count_message_tokens, create_message,
                                    create_response, respond)
from hearth.api.harmony_prompt import render_prompt
from hearth.api.chat_output import ChatEvents
from hearth.api.edge import read_json
from hearth.api.protocol import ChatCompletionRequest, TokenizeRequest, parse_request
from hearth.server.serving import ServerState, check_model, check_prompt_chars
from hearth.server.serving_chat import chat_events


def worker_backend(state: ServerState, request: Request) -> ChatBackend:
    async def run(body: dict[str, Any]) -> ChatEvents:
        chat_request = parse_request(ChatCompletionRequest, body)
        return await chat_events(state, chat_request, None if chat_request.stream
                                 else request.is_disconnected)

    return run


def _count_tokens(state: ServerState, body: TokenizeRequest) -> int:
    """(on the CPU pool) The prompt's token count, rendered as a chat request renders it."""
    text = render_prompt(state.tokenizer, state.chat_format, body.messages or [], body.tools, True)
    check_prompt_chars(state, text, "messages")
    return len(state.tokenizer.encode(text))


def front_door_routes(worker: Any) -> APIRouter:
    """POST /v1/responses, GET /v1/responses/{id}, POST /v1/messages, /v1/messages/count_tokens
    on a worker (`worker`: hearth.server.worker_app.Worker)."""
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

"""The Responses and Messages APIs on the router: translated at the router's edge.

A request on /v1/responses or /v1/messages becomes the internal chat request
(hearth/server/worker_front_doors.py) and runs through the router's own chat pipeline: tokenized for the
cache view, routed by the same cache-aware policy, PD-orchestrated (prefill hop + decode hop),
stitched, retried. Its stitched Chat Completions stream is read back into ChatEvents and written
in the client's API by the same writers a worker uses.

Why translate here rather than forward the API to a worker: the PD hops, the stitcher and its
resume-after-failure logic exist for the chat stream only; translating once at the edge gives the
new APIs all of that (and the router's `previous_response_id` store sees every turn, whichever
worker served it) with no second copy of hops or stitching per API.
"""

from __future__ import annotations

from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import Response

from hearth.router.orchestrator import ResponseStream
from hearth.router.stitch import DONE, parse_sse_data
from hearth.api.chat_output import ChatChunkReader, ChatEvent, ChatEvents
from hearth.api.edge import read_json
from hearth.api.front_doors import (ChatBackend, count_message_tokens, create_message,
                                    create_response, respond)


def router_backend(router: Any, request: Request) -> ChatBackend:
    """`router`: hearth.router.router_app.Router. Always a streamed chat request inside: one path for
    both modes, and usage (with cached tokens) arrives in the stream's last chunk."""
    async def run(body: dict[str, Any]) -> ChatEvents:
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        job = await router.job(body, request, chat=True)
        stream = await router.orchestrator.run(job)
        return ChatEvents(_read(stream), stream.aclose)

    return run


async def _read(stream: ResponseStream) -> AsyncIterator[ChatEvent]:
    reader = ChatChunkReader()
    try:
        async for chunk in stream:
            payload = parse_sse_data(chunk.strip())
            if payload is DONE:
                events = reader.done()
            elif isinstance(payload, dict):
                events = reader.feed(payload)
            else:
                events = []
            for event in events:
                yield event
        for event in reader.done():  # a stream cut before [DONE] ends as Failed
            yield event
    finally:
        await stream.aclose()


def front_door_routes(router: Any) -> APIRouter:
    routes = APIRouter()
    limit = router.config.max_body_bytes

    @routes.post("/v1/responses")
    async def responses(request: Request) -> Response:
        raw = await read_json(request, limit, router.cpu)
        return respond(await create_response(raw, router_backend(router, request),
                                             router.response_store, router.model_name))

    @routes.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> dict:
        return router.response_store.get(response_id).body

    @routes.post("/v1/messages")
    async def messages(request: Request) -> Response:
        raw = await read_json(request, limit, router.cpu)
        return respond(await create_message(raw, router_backend(router, request), router.model_name))

    @routes.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> dict:
        raw = await read_json(request, limit, router.cpu)

        async def count(body: dict[str, Any]) -> int:
            # `model` checked (404 model_not_found) and mapped to the workers' name, as on /tokenize
            model = raw.get("model") if isinstance(raw, dict) else None
            tokenize = router.for_worker({**body, "model": model})
            return int((await router.ask_worker("/tokenize", tokenize))["count"])

        return await count_message_tokens(raw, count)

    return routes

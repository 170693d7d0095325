"""The FastAPI app of one worker: routes, auth, body limit, OpenAI-shaped errors.

The HTTP process never runs the model: the engine lives in its own process behind
`EngineClient`. This process only renders templates, tokenizes, parses tool calls and moves
bytes, so /health stays responsive during long prefills.

Routes (auth with --api-key on all but /health and /metrics):
    GET  /health              200 {"status": "ok"} once the model is loaded, else 503
    GET  /v1/models           the served model, under each of its names (--served-model-name A B)
    GET  /v1/models/{id}      one of them; an unknown id is OpenAI's 404 model_not_found
    POST /v1/chat/completions, /v1/completions
    POST /v1/responses, GET /v1/responses/{id}        (hearth/server/worker_front_doors.py)
    POST /v1/messages, /v1/messages/count_tokens      (Anthropic-shaped errors)
    POST /tokenize, /detokenize
    GET  /load                JSON load report (?check_pool=1 adds kv_pool_is_whole)
    GET  /metrics             Prometheus text
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from typing import Any, Callable

import msgspec
from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from hearth.config import EngineConfig
from hearth.api.harmony_prompt import render_prompt, resolve_chat_format
from hearth.api.edge import SSE_HEADERS, CpuPool, check_api_key, longest_token_chars, read_json
from hearth.server.engine_client import CoreProcess, EngineClient, EngineDeadError
from hearth.api.errors import install_error_handlers
from hearth.server.worker_front_doors import front_door_routes
from hearth.api.load_report import BlockEvents, LoadReport, TierEvents, encode_load_report
from hearth.server.worker_metrics import CONTENT_TYPE, ServerMetrics
from hearth.api.middleware import install_edge_middleware
from hearth.api.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    bad_request,
    parse_request,
)
from hearth.api.chat_chunks import TokenTexts
from hearth.api.responses_api import ResponseStore
from hearth.server.server_config import ServerConfig
from hearth.server.serving import ClientGone, ServerState, check_model, check_prompt_chars, check_token_ids
from hearth.server.serving_chat import create_chat_completion
from hearth.server.serving_completions import create_completion
from hearth.server.reasoning_parsers import HARMONY_REASONING, PARSER_CLASSES, check_reasoning_parser
from hearth.server.tool_parsers import TOOL_PARSERS, tool_parser_for_template

log = logging.getLogger("hearth.server")



def load_tokenizer(engine_config: EngineConfig):
    """The same tokenizer the engine builds, loaded here to keep tokenization off the engine
    (from the checkpoint's tokenizer data alone: this process never imports torch)."""
    from hearth.engine.text.tokenizer import Tokenizer
    from hearth.models.loader import load_tokenizer_source

    if engine_config.model.tokenizer:
        return Tokenizer.from_folder(engine_config.model.tokenizer)
    return Tokenizer.from_source(load_tokenizer_source(engine_config.model.model))


def resolve_tool_parser(name: str, tokenizer: Any, chat_format: str = "template") -> str:
    """`--tool-call-parser`: auto -> the format the chat template writes (the harmony format's
    own under --chat-format harmony, which only it can read)."""
    if chat_format == "harmony":
        if name not in ("auto", "openai"):
            raise ValueError(f"--tool-call-parser {name} cannot read the harmony format's calls "
                             "(--chat-format harmony): use openai or auto")
        return "openai"
    if name == "auto":
        return tool_parser_for_template(getattr(tokenizer, "chat_template", None))
    if name not in TOOL_PARSERS:
        raise ValueError(f"--tool-call-parser: unknown {name!r}; one of auto, {', '.join(TOOL_PARSERS)}")
    return name


def resolve_reasoning_parser(name: str | None, chat_format: str) -> str | None:
    """The harmony format's output always has channels: its parser unless another one is named
    (which cannot read them: an error at startup)."""
    if chat_format != "harmony":
        return name
    if name is None:
        return HARMONY_REASONING
    if PARSER_CLASSES[name] is not PARSER_CLASSES[HARMONY_REASONING]:
        raise ValueError(f"--reasoning-parser {name} cannot read the harmony format's output "
                         f"(--chat-format harmony): use {HARMONY_REASONING} or leave it out")
    return name


class Worker:
    """Everything the routes share; `state` is set once the engine is ready."""

    def __init__(self, engine_config: EngineConfig, server_config: ServerConfig,
                 on_fatal: Callable[[], None] | None = None, core: CoreProcess | None = None) -> None:
        check_reasoning_parser(server_config.reasoning_parser)  # before the engine starts
        self.engine_config = engine_config
        self.config = server_config
        self.on_fatal = on_fatal  # asks the HTTP server to stop (launch.py wires uvicorn's)
        self.engine = EngineClient(engine_config, log_level=server_config.log_level.upper(),
                                   on_dead=self._fail, core=core)
        self.cpu = CpuPool(server_config.cpu_threads)
        self.response_store = ResponseStore()  # past Responses, for previous_response_id
        self.state: ServerState | None = None
        self.failure: str | None = None
        self._startup: asyncio.Task | None = None

    def _fail(self, reason: str) -> None:
        """A worker without its engine cannot serve: stop (exit code 1) so a supervisor sees it,
        rather than keep a listening socket that only answers 503."""
        self.failure = self.failure or reason
        if self.config.exit_on_engine_failure and self.on_fatal is not None:
            log.error("stopping the server: %s", reason)
            self.on_fatal()

    async def start(self) -> None:
        await self.engine.start()
        self._startup = asyncio.create_task(self._finish_startup(), name="worker-startup")

    async def _finish_startup(self) -> None:
        try:
            tokenizer = await asyncio.to_thread(load_tokenizer, self.engine_config)
            info = await self.engine.wait_ready()
        except EngineDeadError:
            return  # on_dead already reported it
        except Exception as exc:
            log.exception("tokenizer failed to load")
            self._fail(f"tokenizer failed to load: {exc}")
            return
        try:
            chat_format = resolve_chat_format(self.config.chat_format, tokenizer.chat_template)
            reasoning_parser = resolve_reasoning_parser(self.config.reasoning_parser, chat_format)
            tool_parser = resolve_tool_parser(self.config.tool_call_parser, tokenizer, chat_format)
        except ValueError as exc:
            self._fail(str(exc))
            return
        names = self.config.served_model_names or (info.model_name,)
        name = names[0]
        self.state = ServerState(
            engine=self.engine, tokenizer=tokenizer, config=self.config,
            metrics=ServerMetrics(name, block_size=info.block_size,
                                  num_blocks=info.stats.num_total_blocks),
            model_name=name, max_model_len=info.max_model_len,
            tool_parser=tool_parser,
            token_texts=TokenTexts(tokenizer), cpu=self.cpu,
            max_token_chars=await asyncio.to_thread(longest_token_chars, tokenizer),
            role=self.engine_config.kv_transfer.role, aliases=tuple(names[1:]),
            chat_format=chat_format, reasoning_parser=reasoning_parser,
        )
        self.state.metrics.set_engine_stats(info.stats)
        log.info("serving %s on http://%s:%d", " | ".join(names), self.config.host,
                 self.config.port)

    async def stop(self) -> None:
        if self._startup is not None:
            self._startup.cancel()
        await self.engine.close()
        self.cpu.close()

    def ready_state(self) -> ServerState:
        if self.state is None or not self.engine.is_ready or self.failure:
            failure = self.failure or self.engine.failure
            raise APIError(503, failure or "the model is still loading", "service_unavailable",
                           code="engine_unavailable" if failure else "not_ready")
        return self.state


def build_app(engine_config: EngineConfig, server_config: ServerConfig,
              on_fatal: Callable[[], None] | None = None, core: CoreProcess | None = None) -> FastAPI:
    """`core`: an engine-core process already spawned for `engine_config` (the app owns it from
    here); None: the app spawns its own at startup."""
    worker = Worker(engine_config, server_config, on_fatal, core)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await worker.start()
        try:
            yield
        finally:
            await worker.stop()

    app = FastAPI(title="hearth", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.worker = worker
    _install_error_handlers(app)
    install_edge_middleware(app, server_config.allowed_origins, server_config.access_log,
                            server_config.doorway.body_timeout_seconds)
    auth = [Depends(_authorizer(worker))]

    @app.get("/health")
    async def health() -> Response:
        failure = worker.failure or worker.engine.failure
        if failure:
            return JSONResponse({"status": "failed", "error": failure}, status_code=503)
        if worker.state is None:
            return JSONResponse({"status": "loading"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        state = worker.ready_state()
        state.metrics.set_engine_stats(state.engine.stats)
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    app.include_router(_openai_routes(worker), dependencies=auth)
    app.include_router(front_door_routes(worker), dependencies=auth)
    app.include_router(_tokenizer_and_load_routes(worker), dependencies=auth)
    return app


def _authorizer(worker: Worker) -> Callable:
    async def authorize(request: Request) -> None:
        try:
            check_api_key(request.headers, worker.config.api_key)
        except APIError:
            if worker.state is not None:
                worker.state.metrics.observe_rejected("auth")
            raise

    return authorize


def _openai_routes(worker: Worker) -> APIRouter:
    router = APIRouter()
    limit = worker.config.max_body_bytes

    async def read(request: Request, model: type) -> Any:
        return parse_request(model, await read_json(request, limit, worker.cpu))

    created = int(time.time())

    def model_card(state: ServerState, name: str) -> dict:
        return {"id": name, "object": "model", "created": created, "owned_by": "hearth",
                "max_model_len": state.max_model_len}

    @router.get("/v1/models")
    async def models() -> dict:
        state = worker.ready_state()
        return {"object": "list", "data": [model_card(state, n) for n in state.model_names]}

    @router.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        state = worker.ready_state()
        check_model(state, model_id)
        return model_card(state, model_id)

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        state = worker.ready_state()
        chat_request = await read(request, ChatCompletionRequest)
        _log_affinity(request)
        return _respond(await create_chat_completion(state, chat_request, request.is_disconnected))

    @router.post("/v1/completions")
    async def completions(request: Request) -> Response:
        state = worker.ready_state()
        completion_request = await read(request, CompletionRequest)
        _log_affinity(request)
        return _respond(await create_completion(state, completion_request, request.is_disconnected))

    return router


def _tokenizer_and_load_routes(worker: Worker) -> APIRouter:
    router = APIRouter()
    limit = worker.config.max_body_bytes

    @router.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        state = worker.ready_state()
        body = parse_request(TokenizeRequest, await read_json(request, limit, worker.cpu))
        check_model(state, body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give exactly one of prompt or messages", param="prompt")
        tokens = await state.cpu.run(_tokenize, state, body)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": state.max_model_len}

    @router.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        state = worker.ready_state()
        body = parse_request(DetokenizeRequest, await read_json(request, limit, worker.cpu))
        check_model(state, body.model)
        check_token_ids(state, body.tokens, "tokens")
        return {"prompt": await state.cpu.run(state.tokenizer.decode, body.tokens)}

    @router.get("/load")
    async def load(check_pool: bool = False,
                   events_since: int | None = Query(default=None, ge=0, le=2**63 - 1)) -> Response:
        state = worker.ready_state()
        reply = await state.engine.load(check_pool=check_pool, events_since=events_since)
        state.metrics.set_engine_stats(reply.stats)
        report = LoadReport(**msgspec.structs.asdict(reply.stats), role=state.role,
                            block_size=worker.engine.info.block_size,
                            num_requests_inflight=state.engine.num_requests)
        if check_pool:
            report.kv_pool_is_whole = reply.kv_pool_is_whole
        if events_since is not None:  # the router's view of this worker's prefix cache
            report.block_events = BlockEvents(reply.events_cursor, reply.stored_hashes,
                                              reply.evicted_hashes)
            if reply.tier_hashes:  # KV tiers below the pool (docs/kv_tiers.md)
                report.block_events.tiers = {tier: TierEvents(stored, evicted) for tier, (
                    stored, evicted) in reply.tier_hashes.items()}
        return Response(encode_load_report(report), media_type="application/json")

    return router


def _tokenize(state: ServerState, body: TokenizeRequest) -> list[int]:
    """(on the CPU pool) The request's token ids."""
    if body.messages is not None:
        text = render_prompt(state.tokenizer, state.chat_format, body.messages, body.tools,
                             body.add_generation_prompt)
        param = "messages"
    else:
        text, param = body.prompt, "prompt"
    check_prompt_chars(state, text, param)
    return state.tokenizer.encode(text, add_special_tokens=body.add_special_tokens)


def _respond(result: Any) -> Response:
    if isinstance(result, dict):
        return JSONResponse(result)
    return StreamingResponse(result, media_type="text/event-stream", headers=SSE_HEADERS)


def _log_affinity(request: Request) -> None:
    key = request.headers.get("x-session-affinity")
    if key:
        log.debug("x-session-affinity: %s", key)


def _install_error_handlers(app: FastAPI) -> None:
    install_error_handlers(app)  # the shared ones; then what only a worker meets

    @app.exception_handler(ClientGone)
    async def client_gone(_: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)  # nobody is listening; the requests were aborted

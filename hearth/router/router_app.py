"""The router's FastAPI app: the same OpenAI API as a worker, in front of the worker pools.

Routes (auth with --api-key on all but /health and /metrics):
    GET  /health              200 once a decode (or monolithic) endpoint is healthy, else 503
    GET  /v1/models           the model the workers serve, under each name (--served-model-name)
    GET  /v1/models/{id}      one of them; an unknown id (or `model`) is a 404 model_not_found
    POST /v1/chat/completions, /v1/completions    routed, PD-orchestrated, stitched
    POST /v1/responses, /v1/messages              translated into chat at the edge, then the same
    GET  /v1/responses/{id}; POST /v1/messages/count_tokens   (hearth/router/router_front_doors.py)
    POST /tokenize, /detokenize                   forwarded to a healthy worker
    GET  /load                the router's view: endpoints, estimated loads, cache views
    GET  /metrics             Prometheus text (hearth/router/router_metrics.py)

Errors have the OpenAI shape; a worker's own 4xx about a request reaches the client unchanged.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from typing import Any, Callable

import httpx
import msgspec
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from hearth.router.discovery import DiscoveryLoop, Registry
from hearth.router.endpoints import EndpointPool, SessionTable
from hearth.router.router_front_doors import front_door_routes
from hearth.router.health import HealthChecker, ModelInfo
from hearth.router.hops import HopError, WorkerRejected, forward_headers, post_json
from hearth.router.router_metrics import CONTENT_TYPE, RouterMetrics
from hearth.router.orchestrator import Job, Orchestrator
from hearth.router.policy import NoEndpointError
from hearth.router.prompts import PromptTokens
from hearth.router.router_config import RouterConfig
from hearth.api.edge import SSE_HEADERS, CpuPool, check_api_key, read_json
from hearth.api.errors import error_response, install_error_handlers
from hearth.api.middleware import install_edge_middleware
from hearth.api.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    bad_request,
    model_not_found,
    parse_request,
)
from hearth.api.responses_api import ResponseStore

log = logging.getLogger("hearth.router")



class Router:
    """What the routes share; built in the app's lifespan."""

    def __init__(self, config: RouterConfig, tokenizer: Any | None,
                 registry: Registry | None = None) -> None:
        self.config = config
        self.pool = EndpointPool(list(config.prefill), list(config.decode), list(config.workers),
                                 dynamic=registry is not None)
        self.metrics = RouterMetrics()
        self.cpu = CpuPool(config.cpu_threads)
        self.model = ModelInfo()
        self.prompts = PromptTokens(tokenizer, self.cpu, self.model)
        # Fresh connections per hop: a worker that died never leaves a stale pooled socket.
        self.client = httpx.AsyncClient(limits=httpx.Limits(max_keepalive_connections=0,
                                                            max_connections=None))
        self.sessions = SessionTable(config.session_capacity)
        self.response_store = ResponseStore()  # past Responses, for previous_response_id
        self.health = HealthChecker(self.pool, self.client, config.health,
                                    config.worker_api_key, self.model, config.policy.block_size)
        self.orchestrator = Orchestrator(config, self.pool, self.sessions, self.metrics, self.client,
                                         self.model)
        self.discovery = (DiscoveryLoop(registry, self.pool, config.health.discovery_interval_seconds,
                                        self.health.endpoints_changed)
                          if registry is not None else None)
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        self._tasks.append(asyncio.create_task(self.health.run(), name="router-health"))
        if self.discovery is not None:
            await self.discovery.poll_once()  # the workers registered so far, before serving
            self._tasks.append(asyncio.create_task(self.discovery.run(), name="router-discovery"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await self.client.aclose()
        self.cpu.close()

    @property
    def model_name(self) -> str:
        return self.model_names[0] if self.model_names else "unknown"

    @property
    def model_names(self) -> tuple[str, ...]:
        """The names clients may give: the router's own (--served-model-name), else the workers'."""
        return self.config.served_model_names or self.model.names

    def for_worker(self, raw: Any) -> Any:
        """The request body to forward: its `model` checked (404 model_not_found) and, where the
        router's own names differ from the workers', replaced by the workers' name."""
        model = raw.get("model") if isinstance(raw, dict) else None
        if not isinstance(model, str) or not self.model_names:
            return raw  # not known yet (no healthy worker), or no model given: the worker decides
        if model not in self.model_names:
            raise model_not_found(model)
        if self.model.name is not None and model not in self.model.names:
            return {**raw, "model": self.model.name}
        return raw

    async def ask_worker(self, path: str, body: dict) -> dict:
        """POST to any healthy endpoint (tokenize/detokenize), trying each in turn."""
        headers = forward_headers({}, self.config.worker_api_key)
        error: Exception = NoEndpointError("no healthy endpoint")
        for endpoint in self.pool:
            if endpoint.healthy:
                try:
                    return await post_json(self.client, endpoint.url, path, body, headers,
                                           self.config.timeouts)
                except HopError as exc:
                    error = exc
        raise error

    async def job(self, raw: Any, request: Request, chat: bool) -> Job:
        model = ChatCompletionRequest if chat else CompletionRequest
        raw = self.for_worker(raw)
        parsed = parse_request(model, raw)
        if parsed.kv_transfer is not None:
            raise bad_request("kv_transfer is set by the router, not by clients", param="kv_transfer")
        ask = lambda body: self.ask_worker("/tokenize", body)  # noqa: E731
        try:
            ids = await (self.prompts.chat(parsed, raw, ask) if chat
                         else self.prompts.completion(parsed, ask))
        except (HopError, NoEndpointError) as exc:
            log.warning("could not tokenize for routing (%s); routing without the cache view", exc)
            ids = None
        max_tokens = parsed.max_tokens
        if chat and parsed.max_completion_tokens is not None:
            max_tokens = parsed.max_completion_tokens
        can_split = (ids is not None and parsed.n == 1 and (max_tokens is None or max_tokens >= 2)
                     and (chat or not parsed.echo))
        greedy = parsed.temperature == 0 or parsed.top_k == 1
        one_output = parsed.n == 1 and (chat or (not parsed.echo and (
            isinstance(parsed.prompt, str) or not parsed.prompt
            or isinstance(parsed.prompt[0], int))))
        return Job(chat=chat, raw=raw, headers=forward_headers(request.headers, self.config.worker_api_key),
                   model=self.model_name, prompt_ids=ids,
                   session_key=request.headers.get("x-session-affinity"),
                   can_disaggregate=can_split, deterministic=greedy, resumable=one_output)

    def load_view(self) -> dict:
        """Worker addresses are internal: shown only behind the router's key, or by choice."""
        show_urls = self.config.api_key is not None or self.config.show_worker_urls
        return {"model": self.model_name, "num_sessions": len(self.sessions), "endpoints": [
            {"url": e.url if show_urls else f"endpoint-{index}", "role": e.role,
             "healthy": e.healthy, "draining": e.draining, "name": e.name,
             "last_error": e.last_error if show_urls or e.last_error is None else "(hidden)",
             "prefill_tokens": e.prefill_tokens, "decode_tokens": e.decode_tokens,
             "own_requests": e.own_requests, "cached_blocks": len(e.cache),
             "routed": e.counters.routed, "failures": e.counters.failures,
             "retries": e.counters.retries,
             "predicted_cached_tokens": e.counters.predicted_cached_tokens,
             "reported_cached_tokens": e.counters.reported_cached_tokens,
             "refused": e.refusal,
             "report": msgspec.to_builtins(e.report) if e.report is not None else {}}
            for index, e in enumerate(self.pool)]}


def build_app(config: RouterConfig, tokenizer: Any | None = None,
              supervisor_state: Callable[[], dict] | None = None,
              registry: Registry | None = None) -> FastAPI:
    """`supervisor_state`: under `hearth up`, its workers' restarts, shown in /health.
    `registry`: where the workers come from at run time (hearth/router/discovery.py) instead of
    the config's URL lists (a cluster deployment, hearth/cluster/)."""
    router = Router(config, tokenizer, registry)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    app = FastAPI(title="hearth router", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.router = router
    _install_error_handlers(app)
    install_edge_middleware(app, config.allowed_origins, config.access_log,
                            config.doorway.body_timeout_seconds, cancel_on_disconnect=True)

    async def authorize(request: Request) -> None:
        check_api_key(request.headers, config.api_key)

    auth = [Depends(authorize)]

    @app.get("/health")
    async def health() -> Response:
        extra = {"supervisor": supervisor_state()} if supervisor_state else {}
        refused = [f"endpoint-{i}: {e.refusal}" for i, e in enumerate(router.pool) if e.refusal]
        if refused:  # workers that answer but break the contract (e.g. another --block-size)
            extra["refused"] = refused
        if not router.pool.is_ready() or router.model.name is None:
            return JSONResponse({"status": "waiting for a healthy decode endpoint", **extra},
                                status_code=503)
        return JSONResponse({"status": "ok", **extra})

    created = int(time.time())

    def model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": created, "owned_by": "hearth",
                "max_model_len": router.model.max_model_len}

    @app.get("/v1/models", dependencies=auth)
    async def models() -> dict:
        return {"object": "list", "data": [model_card(n) for n in router.model_names]}

    @app.get("/v1/models/{model_id:path}", dependencies=auth)
    async def model(model_id: str) -> dict:
        if model_id not in router.model_names:
            raise model_not_found(model_id)
        return model_card(model_id)

    async def complete(request: Request, chat: bool) -> Response:
        raw = await read_json(request, config.max_body_bytes, router.cpu)
        job = await router.job(raw, request, chat)
        result = await router.orchestrator.run(job)
        if isinstance(result, dict):
            return JSONResponse(result)
        return StreamingResponse(result, media_type="text/event-stream", headers=SSE_HEADERS,
                                 background=BackgroundTask(result.aclose))

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(request: Request) -> Response:
        return await complete(request, chat=True)

    @app.post("/v1/completions", dependencies=auth)
    async def completions(request: Request) -> Response:
        return await complete(request, chat=False)

    @app.post("/tokenize", dependencies=auth)
    async def tokenize(request: Request) -> dict:
        return await router.ask_worker("/tokenize", router.for_worker(
            await read_json(request, config.max_body_bytes, router.cpu)))

    @app.post("/detokenize", dependencies=auth)
    async def detokenize(request: Request) -> dict:
        return await router.ask_worker("/detokenize", router.for_worker(
            await read_json(request, config.max_body_bytes, router.cpu)))

    @app.get("/load", dependencies=auth)
    async def load() -> dict:
        return router.load_view()

    app.include_router(front_door_routes(router), dependencies=auth)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(router.metrics.render(router.pool), media_type=CONTENT_TYPE)

    return app


def _install_error_handlers(app: FastAPI) -> None:
    install_error_handlers(app)  # the worker's: APIError, 404, validation, 500

    @app.exception_handler(WorkerRejected)
    async def worker_rejected(request: Request, exc: WorkerRejected) -> JSONResponse:
        return error_response(request, exc.status, exc.body)

    @app.exception_handler(NoEndpointError)
    async def no_endpoint(request: Request, exc: NoEndpointError) -> JSONResponse:
        error = APIError(503, str(exc), "service_unavailable", code="no_healthy_endpoint")
        return error_response(request, 503, error.body())

    @app.exception_handler(HopError)
    async def hop_failed(request: Request, exc: HopError) -> JSONResponse:
        error = APIError(503, f"every endpoint tried failed; last: {exc}", "service_unavailable",
                         code="upstream_unavailable")
        return error_response(request, 503, error.body())

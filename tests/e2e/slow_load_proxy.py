"""A reverse proxy in front of one real worker, whose `/load` answers can be made slow.

It stands in for a worker on a saturated CPU (load reports late, requests still served) as a
real peer on a real socket for router tests: every request is forwarded to the worker and its
response streamed back; `GET /load` first waits the configured delay.

    python -m tests.e2e.slow_load_proxy --upstream http://127.0.0.1:8001 --port 8002
    POST /_proxy/slow?seconds=S   delay every later /load by S seconds (0: none)
    GET  /_proxy/stats            {"num_load_polls": ..., "num_slow_load_polls": ...}
"""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import dataclass

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}


@dataclass
class ProxyState:
    load_delay: float = 0.0
    num_load_polls: int = 0
    num_slow_load_polls: int = 0


def build_app(upstream: str) -> Starlette:
    state = ProxyState()
    client = httpx.AsyncClient(base_url=upstream, timeout=None)

    async def slow(request: Request) -> JSONResponse:
        state.load_delay = float(request.query_params["seconds"])
        return JSONResponse({"load_delay": state.load_delay})

    async def stats(_: Request) -> JSONResponse:
        return JSONResponse({"num_load_polls": state.num_load_polls,
                             "num_slow_load_polls": state.num_slow_load_polls})

    async def forward(request: Request) -> StreamingResponse:
        if request.url.path == "/load":
            state.num_load_polls += 1
            if state.load_delay > 0:
                state.num_slow_load_polls += 1
                await asyncio.sleep(state.load_delay)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        upstream_request = client.build_request(request.method, request.url.path,
                                                params=request.query_params, headers=headers,
                                                content=await request.body())
        response = await client.send(upstream_request, stream=True)
        out_headers = {k: v for k, v in response.headers.items() if k.lower() not in HOP_HEADERS}
        return StreamingResponse(response.aiter_raw(), status_code=response.status_code,
                                 headers=out_headers,
                                 background=BackgroundTask(response.aclose))

    return Starlette(routes=[Route("/_proxy/slow", slow, methods=["POST"]),
                             Route("/_proxy/stats", stats),
                             Route("/{path:path}", forward, methods=["GET", "POST"])])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--port", type=int, required=True)
    a = parser.parse_args()
    uvicorn.run(build_app(a.upstream), host="127.0.0.1", port=a.port, log_level="warning")


if __name__ == "__main__":
    main()

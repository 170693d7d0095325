"""OpenAI-shaped error bodies for every failure an HTTP edge can meet (worker and router);
Anthropic-shaped on the Messages API's paths, whatever raised the error."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from hearth.api.messages_api import MESSAGES_PATH, anthropic_error_body
from hearth.api.protocol import APIError, bad_request

log = logging.getLogger("hearth.server")


def error_response(request: Request, status: int, body: dict) -> JSONResponse:
    """An OpenAI-shaped error body, in the shape of the API the request came in on."""
    if request.url.path.startswith(MESSAGES_PATH):
        body = anthropic_error_body(status, body)
    return JSONResponse(body, status_code=status)


def install_error_handlers(app: FastAPI) -> None:
    """OpenAI-shaped error bodies for every failure (the router installs these too)."""
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(request, exc.status, exc.body())

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            error = APIError(404, f"no route {request.method} {request.url.path}", "not_found_error",
                             code="not_found")
        else:
            error = APIError(exc.status_code, str(exc.detail), "invalid_request_error")
        return error_response(request, exc.status_code, error.body())

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        param = ".".join(str(p) for p in first["loc"][1:]) or None
        return error_response(request, 400, bad_request(first["msg"], param=param).body())

    @app.exception_handler(ClientDisconnect)
    async def client_left(_: Request, exc: ClientDisconnect) -> Response:
        # The client hung up while sending its body: nothing ran and nobody reads an answer;
        # the access log records the 499, as for a client that leaves a running request.
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        error = APIError(500, f"internal error: {type(exc).__name__}: {exc}", "internal_server_error")
        return error_response(request, 500, error.body())


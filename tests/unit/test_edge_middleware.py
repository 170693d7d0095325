"""CORS and the access log (hearth/api/middleware.py) on a small app, no model; the real
worker and router are checked in tests/e2e/test_models_cors_logs.py."""

from __future__ import annotations

import logging

import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from fastapi.testclient import TestClient

from hearth.api.errors import install_error_handlers
from hearth.api.middleware import install_edge_middleware

ORIGIN = "http://localhost:3000"


def make_client(origins: tuple[str, ...] = (), log_requests: bool = True) -> TestClient:
    app = FastAPI()
    install_error_handlers(app)
    install_edge_middleware(app, origins, log_requests)

    @app.post("/v1/chat/completions")
    async def chat() -> dict:
        return {"ok": True}

    @app.get("/stream")
    async def stream() -> StreamingResponse:
        async def body():
            for piece in ("a", "b", "c"):
                yield piece
        return StreamingResponse(body(), media_type="text/plain")

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    return TestClient(app)


def preflight(client: TestClient, origin: str = ORIGIN):
    return client.options("/v1/chat/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})


def test_cors_is_off_by_default():
    client = make_client()
    assert preflight(client).status_code == 405  # no CORS: OPTIONS is not a route
    response = client.post("/v1/chat/completions", headers={"Origin": ORIGIN})
    assert "access-control-allow-origin" not in response.headers


def test_preflight_and_response_of_an_allowed_origin():
    client = make_client((ORIGIN,))
    response = preflight(client)
    assert response.status_code == 200
    assert response.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in response.headers["access-control-allow-methods"]
    assert "authorization" in response.headers["access-control-allow-headers"].lower()
    response = client.post("/v1/chat/completions", headers={"Origin": ORIGIN})
    assert response.headers["access-control-allow-origin"] == ORIGIN
    assert "x-request-id" in response.headers["access-control-expose-headers"]


def test_other_origins_get_no_cors_headers():
    client = make_client((ORIGIN,))
    response = preflight(client, "http://evil.example")
    assert response.status_code == 400
    assert "access-control-allow-origin" not in response.headers


def test_star_allows_any_origin():
    response = preflight(make_client(("*",)), "http://anything.example")
    assert response.status_code == 200
    assert response.headers["access-control-allow-origin"] == "*"


def access_lines(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "hearth.access"]


def test_one_access_line_per_request_with_its_id(caplog):
    client = make_client()
    with caplog.at_level(logging.DEBUG, logger="hearth.access"):
        ok = client.post("/v1/chat/completions", headers={"x-request-id": "abc-123"})
        missing = client.get("/no/such/route")
        streamed = client.get("/stream")
    assert ok.headers["x-request-id"] == "abc-123"  # the client's id is kept and echoed
    fresh = missing.headers["x-request-id"]
    assert len(fresh) == 32 and fresh != streamed.headers["x-request-id"]
    assert streamed.text == "abc"
    lines = [r.getMessage() for r in access_lines(caplog)]
    assert len(lines) == 3
    assert lines[0].startswith("POST /v1/chat/completions 200 ") and lines[0].endswith(" id=abc-123")
    assert lines[1].startswith("GET /no/such/route 404 ") and lines[1].endswith(f" id={fresh}")
    assert lines[2].startswith("GET /stream 200 ")
    assert all(r.levelno == logging.INFO for r in access_lines(caplog))


def test_polls_are_debug_and_the_log_can_be_off(caplog):
    with caplog.at_level(logging.DEBUG, logger="hearth.access"):
        make_client().get("/health")
        assert [r.levelno for r in access_lines(caplog)] == [logging.DEBUG]
        caplog.clear()
        quiet = make_client(log_requests=False)
        assert quiet.get("/stream").headers["x-request-id"]  # ids still go out
        assert access_lines(caplog) == []


@pytest.mark.parametrize("bad", ["x" * 200, "a\x01b"])
def test_an_unusable_client_id_is_replaced(bad):
    response = make_client().get("/health", headers={"x-request-id": bad})
    assert response.headers["x-request-id"] != bad
    assert len(response.headers["x-request-id"]) == 32

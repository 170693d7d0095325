"""The router refuses a real worker that breaks the /load contract: here a KV block size other
than its own (the router hashes prompts in its own block size, so none of that worker's cached
blocks would ever match). The session worker (block size 16) behind a `hearth route
--block-size 32` process: the worker answers, the router keeps it out and says why."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx

from tests.e2e.conftest import API_KEY, MODEL, REPO, Server, free_port, wait_for


def test_router_refuses_a_worker_with_another_block_size(tmp_path, server):
    port = free_port()
    log_path = tmp_path / "router.log"
    cmd = [sys.executable, "-m", "hearth.cli", "route", "--port", str(port), "--health-interval",
           "0.5", "--worker", server.url, "--worker-api-key", API_KEY, "--model", MODEL,
           "--block-size", "32"]
    with open(log_path, "w") as log:
        process = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1"})
    router = Server(process, f"http://127.0.0.1:{port}", None, log_path)
    try:
        health = wait_for(lambda: httpx.get(router.url + "/health", timeout=2).json()
                          .get("refused"), "the refusal in the router's /health", log_path)
        assert health == ["endpoint-0: refused: its KV block size is 16 tokens, the router's is 32 "
                          "(--block-size must be the same on router and workers)"]
        assert httpx.get(router.url + "/health", timeout=5).status_code == 503
        [endpoint] = httpx.get(router.url + "/load", timeout=5).json()["endpoints"]
        assert endpoint["healthy"] is False and "block size is 16" in endpoint["refused"]
        assert "refused: its KV block size is 16 tokens" in log_path.read_text()
        before = server.load()["num_prompt_tokens"]
        response = httpx.post(router.url + "/v1/chat/completions", timeout=30, json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "no_healthy_endpoint"
        assert server.load()["num_prompt_tokens"] == before  # nothing reached the worker
    finally:
        router.stop()

"""Process lifecycle: a worker whose engine cannot start or dies never leaves a client hanging."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from tests.e2e.conftest import MODEL, REPO, free_port, start_server


def children_of(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def test_engine_that_cannot_start_makes_the_server_exit_1():
    process = subprocess.run(
        [sys.executable, "-m", "hearth.cli", "serve", "--model", "/no/such/model.gguf",
         "--port", str(free_port()), "--log-level", "warning"],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert process.returncode == 1
    assert "no/such/model.gguf" in process.stderr


def test_engine_death_mid_stream_ends_the_stream_with_an_error(tmp_path):
    server = start_server(tmp_path)
    try:
        (core_pid,) = children_of(server.process.pid)
        client = server.client()
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Tell me a long story."}],
            max_tokens=500, temperature=0, stream=True, extra_body={"ignore_eos": True})
        first = next(iter(stream))
        assert first.choices[0].delta.role == "assistant"
        os.kill(core_pid, signal.SIGKILL)
        with pytest.raises(openai.APIError):
            for _ in stream:
                pass
        assert server.process.wait(timeout=60) == 1  # the worker stops instead of answering 503s
    finally:
        if server.process.poll() is None:
            server.stop()

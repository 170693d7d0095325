"""Start one OpenAI-compatible server as a child process, time its cold start, stop it cleanly.

A `ServerSpec` is a command line with a `{port}` placeholder and its environment. `start_server`
returns once `/health` answers 200 (or `/v1/models` does, for servers without `/health`); the
cold start is measured from just before the process is spawned. The child runs in its own process
group so `stop_server` also ends whatever it forked (engine cores, compile workers).
Every HTTP probe opens a fresh connection: some servers fail on reused keep-alive sockets.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from hearth.api.readiness import NotReadyError, answers, wait_ready


@dataclass(frozen=True)
class ServerSpec:
    name: str
    argv: tuple[str, ...]  # may hold "{port}"
    port: int
    env: dict[str, str] = field(default_factory=dict)  # added to os.environ

    def command(self) -> list[str]:
        return [a.replace("{port}", str(self.port)) for a in self.argv]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass
class RunningServer:
    spec: ServerSpec
    process: subprocess.Popen
    cold_start_s: float
    log_path: Path


class ServerStartError(RuntimeError):
    pass


PROBE_PATHS = ("/health", "/v1/models")  # peers without /health answer /v1/models once ready


def start_server(spec: ServerSpec, log_path: Path, timeout_s: float) -> RunningServer:
    if answers(spec.url, PROBE_PATHS):
        raise ServerStartError(f"{spec.name}: something already answers on port {spec.port}")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "w")
    start = time.perf_counter()
    process = subprocess.Popen(spec.command(), stdout=log, stderr=subprocess.STDOUT,
                               env={**os.environ, **spec.env}, start_new_session=True)
    log.close()  # the child holds its own descriptor
    try:
        wait_ready(spec.url, process, timeout_s, PROBE_PATHS)
    except NotReadyError as exc:
        if exc.exited:
            raise ServerStartError(f"{spec.name} exited with {process.returncode} before ready; "
                                   f"see {log_path}") from None
        _kill_group(process)
        raise ServerStartError(f"{spec.name} not ready after {timeout_s:.0f} s; see {log_path}") from None
    return RunningServer(spec, process, time.perf_counter() - start, log_path)


def _kill_group(process: subprocess.Popen, grace_s: float = 20) -> None:
    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    except ProcessLookupError:
        pass


def stop_server(server: RunningServer) -> None:
    _kill_group(server.process)
    deadline = time.perf_counter() + 10
    while answers(server.spec.url, PROBE_PATHS) and time.perf_counter() < deadline:  # port freed before the next start
        time.sleep(0.2)


def start_busy_neighbour(core: int) -> subprocess.Popen:
    """A Python process spinning on one core, pinned there with taskset."""
    return subprocess.Popen(["taskset", "-c", str(core), sys.executable, "-c", "while True: pass"])


def stop_busy_neighbour(process: subprocess.Popen) -> None:
    process.kill()
    process.wait()

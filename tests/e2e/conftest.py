"""A real `hearth serve` process on loopback, shared by the e2e tests of a session.

Each server start loads the default model (seconds), so the main server is session-scoped and
requires an API key (the auth tests use the same process). Tests that need other limits start
their own small server through `start_server`.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from hearth.api.readiness import NotReadyError, wait_ready

REPO = Path(__file__).resolve().parents[2]
API_KEY = "test-key"
MODEL = "smollm2-135m-instruct"
STARTUP_SECONDS = 180
# The e2e tests compare greedy outputs across servers (PD against monolithic, a retried request
# against its first try), whose steps are composed differently (batching, cache hits). The exact
# format is the reference for that: `hearth serve`'s defaults (`--prefill-dtype auto`: steps
# of more than 16 rows in bf16 on AMX machines; `--kv-cache-dtype auto`: bf16 KV) round, so a
# token's numbers would depend on the step it landed in. Servers here pin the exact formats
# before their own flags (a later flag wins);
# test_defaults.py runs the defaults as a user gets them.
EXACT_FLAGS = ("--prefill-dtype", "float32", "--kv-cache-dtype", "model")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Server:
    process: subprocess.Popen
    url: str  # http://127.0.0.1:PORT
    api_key: str | None
    log_path: Path

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key=self.api_key or "none", max_retries=0,
                             timeout=120, **kwargs)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.base_url, api_key=self.api_key or "none",
                                  max_retries=0, timeout=120)

    def load(self, check_pool: bool = False) -> dict:
        params = {"check_pool": "true"} if check_pool else {}
        response = httpx.get(self.url + "/load", params=params, headers=self.headers(), timeout=30)
        response.raise_for_status()
        return response.json()

    def wait_idle_and_whole(self, timeout: float = 60.0) -> dict:
        """Poll until no request is in flight; return the last load report (with pool check)."""
        deadline = time.monotonic() + timeout
        report = self.load(check_pool=True)
        while time.monotonic() < deadline:
            report = self.load(check_pool=True)
            if report["num_requests_inflight"] == 0 and report["num_running"] == 0 \
                    and report["num_waiting"] == 0:
                return report
            time.sleep(0.2)
        return report

    def stop(self) -> None:
        stop_all(self)


def stop_all(*servers: Server) -> None:
    """Terminate every one first, then wait for each: their shutdowns overlap."""
    for server in servers:
        if server.process.poll() is None:
            server.process.terminate()
    for server in servers:
        try:
            server.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait()


def start_server(tmp_dir: Path, *flags: str, api_key: str | None = None,
                 exact: bool = True) -> Server:
    return wait_healthy(launch_server(tmp_dir, *flags, api_key=api_key, exact=exact))


def start_servers(tmp_dir: Path, *flag_sets: tuple[str, ...], at_once: int = 2) -> list[Server]:
    """Several workers, `at_once` starting together (one per core: a start is mostly one busy
    thread, more at once only thrash); all healthy, or none left running."""
    servers: list[Server] = []
    try:
        for i in range(0, len(flag_sets), at_once):
            batch = [launch_server(tmp_dir, *flags) for flags in flag_sets[i : i + at_once]]
            servers += batch
            for server in batch:
                wait_healthy(server)
        return servers
    except BaseException:
        for server in servers:
            server.stop()
        raise


def launch_server(tmp_dir: Path, *flags: str, api_key: str | None = None,
                  exact: bool = True) -> Server:
    """`hearth serve` started, not yet waited for (see `wait_healthy`); `exact`: with
    EXACT_FLAGS before `flags`."""
    port = free_port()
    log_path = tmp_dir / f"server-{port}.log"
    cmd = [sys.executable, "-m", "hearth.cli", "serve", "--model", MODEL, "--host", "127.0.0.1",
           "--port", str(port), "--log-level", "info", *(EXACT_FLAGS if exact else ()), *flags]
    if api_key:
        cmd += ["--api-key", api_key]
    log_file = open(log_path, "w")
    process = subprocess.Popen(cmd, cwd=REPO, stdout=log_file, stderr=subprocess.STDOUT,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return Server(process, f"http://127.0.0.1:{port}", api_key, log_path)


def wait_healthy(server: Server) -> Server:
    try:
        wait_ready(server.url, server.process, STARTUP_SECONDS)
    except NotReadyError as exc:
        if not exc.exited:
            server.stop()
        raise RuntimeError(f"{exc}:\n{server.log_path.read_text()[-3000:]}") from None
    return server


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> Server:
    srv = start_server(tmp_path_factory.mktemp("server"), "--max-body-mb", "1", api_key=API_KEY)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def client(server) -> openai.OpenAI:
    return server.client()


@pytest.fixture(scope="session")
def gpt_oss_served(tmp_path_factory) -> tuple[Server, dict[str, int]]:
    """One server on a tiny random gpt-oss folder with a harmony tokenizer, for every test file
    that needs it (tests/e2e/harmony_model.py); (server, the harmony tokens' ids)."""
    pytest.importorskip("transformers")
    from tests.e2e.harmony_model import start_harmony_server, stop_whole, write_gpt_oss_folder

    folder = tmp_path_factory.mktemp("gpt_oss_serve")
    ids = write_gpt_oss_folder(folder / "model")
    server = start_harmony_server(folder, folder / "model")
    yield server, ids
    stop_whole(server)


def start_router(tmp_dir: Path, *flags: str, api_key: str | None = None) -> Server:
    """`hearth route` on loopback with `flags` (its endpoints, --model ...); ready once every
    endpoint it lists is healthy."""
    port = free_port()
    log_path = tmp_dir / f"router-{port}.log"
    cmd = [sys.executable, "-m", "hearth.cli", "route", "--port", str(port),
           "--health-interval", "0.5", "--log-level", "info", *flags]
    if api_key:
        cmd += ["--api-key", api_key]
    process = subprocess.Popen(cmd, cwd=REPO, stdout=open(log_path, "w"), stderr=subprocess.STDOUT,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    router = Server(process, f"http://127.0.0.1:{port}", api_key, log_path)
    deadline = time.monotonic() + STARTUP_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"router exited:\n{log_path.read_text()[-3000:]}")
        try:
            view = httpx.get(router.url + "/load", headers=router.headers(), timeout=2).json()
            if view["endpoints"] and all(e["healthy"] for e in view["endpoints"]) \
                    and httpx.get(router.url + "/health", timeout=2).status_code == 200:
                return router
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.3)
    router.stop()
    raise RuntimeError(f"router endpoints not healthy:\n{log_path.read_text()[-3000:]}")


@pytest.fixture(scope="session")
def edge_router(tmp_path_factory, server) -> Server:
    """A router with its own tokenizer and no client key in front of the session server."""
    srv = start_router(tmp_path_factory.mktemp("router"), "--worker", server.url,
                       "--worker-api-key", API_KEY, "--model", MODEL, "--max-body-mb", "1")
    yield srv
    srv.stop()


def wait_for(condition, what: str, log_path: Path, timeout: float = 120.0):
    """Poll `condition()` until it returns something truthy; at the deadline fail with the log."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            result = condition()
        except (httpx.HTTPError, ValueError, KeyError):
            result = None
        if result:
            return result
        time.sleep(0.2)
    pytest.fail(f"{what}: not seen after {timeout:.0f}s\n{log_path.read_text()[-4000:]}")

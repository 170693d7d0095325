"""`hearth up`: router + prefill pool + decode pool (+ monolithic workers) on one machine.

`up(UpConfig, EngineConfig, ServerConfig, RouterConfig, worker_command)` is a plain function over
configs (hearth/flags/ builds them from `hearth up`'s flags). Each worker is `hearth serve` on a
free loopback port, its argv derived from its own configs by `worker_command` (hearth/cli.py's,
over hearth/flags/'s `serve_argv`, which holds the flag names; this module holds none): up's
EngineConfig with the worker's role, and a ServerConfig with its address. This process waits until every worker is
healthy, then runs the router itself (`route`) while a supervisor (hearth/router/supervisor.py)
restarts any worker that exits. Invariants:
  * no worker outlives this process: they are terminated on exit, on SIGINT/SIGTERM, when
    startup fails, and (PR_SET_PDEATHSIG) even if this process is killed outright;
  * a worker that exits before it was ever healthy fails the startup (exit 1, one log line);
    after that it is restarted on its port, and one that keeps dying stops the stack (exit 1);
  * `--pin` gives every worker its own cores (sched_setaffinity in the child before exec, and
    OMP_NUM_THREADS to match), so one machine stands in for separate prefill and decode
    hardware: with 2 cores and 1 + 1 workers, prefill runs on core 0 and decode on core 1;
  * workers get an API key and a KV secret that only the router knows (random unless given),
    in their environment (HEARTH_API_KEY, HEARTH_KV_SECRET), never on a command line.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

from hearth.config import EngineConfig
from hearth.router.router_launch import route
from hearth.router.router_config import RouterConfig, UpConfig
from hearth.router.supervisor import Supervisor, WorkerSpec
from hearth.api.readiness import NotReadyError, wait_ready
from hearth.server.server_config import ServerConfig

log = logging.getLogger("hearth.up")

# argv of a `hearth serve` child serving these configs (hearth/cli.py's worker_command)
WorkerCommand = Callable[[EngineConfig, ServerConfig], list[str]]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def core_sets(num_workers: int, cores: list[int]) -> list[list[int]]:
    """Disjoint, contiguous core slices, one per worker (shared round robin if too few cores)."""
    if num_workers <= len(cores):
        per = len(cores) // num_workers
        return [cores[i * per:(i + 1) * per] for i in range(num_workers)]
    log.warning("--pin: %d workers on %d cores; some share a core", num_workers, len(cores))
    return [[cores[i % len(cores)]] for i in range(num_workers)]


def worker_env(role: str, api_key: str, kv_secret: str, cores: list[int] | None) -> dict[str, str]:
    """The worker's environment: this one's, plus its secrets (hearth/flags/ reads them)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HEARTH_API_KEY": api_key}
    env.pop("HEARTH_WORKER_API_KEY", None)
    if role == "both":
        env.pop("HEARTH_KV_SECRET", None)
    else:
        env["HEARTH_KV_SECRET"] = kv_secret
    if cores:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(len(cores))
    return env


def worker_specs(stack: UpConfig, engine: EngineConfig, server: ServerConfig,
                 worker_command: WorkerCommand, api_key: str, kv_secret: str) -> list[WorkerSpec]:
    roles = ["prefill"] * stack.num_prefill + ["decode"] * stack.num_decode \
        + ["both"] * stack.num_workers
    if not roles or (stack.num_decode == 0 and stack.num_workers == 0):
        raise ValueError("hearth up needs --decode >= 1 or --workers >= 1")
    if stack.num_prefill and not stack.num_decode:
        raise ValueError("--prefill workers need --decode workers to hand their KV to")
    pins = (core_sets(len(roles), sorted(os.sched_getaffinity(0))) if stack.pin
            else [None] * len(roles))
    log_dir = Path(stack.log_dir) if stack.log_dir else None
    if log_dir:
        log_dir.mkdir(parents=True, exist_ok=True)
    specs = []
    for role, cores in zip(roles, pins):
        port = free_port()
        # Secrets go in the environment (worker_env), never into the configs argv comes from.
        worker_engine = replace(engine, kv_transfer=replace(engine.kv_transfer, role=role,
                                                            secret=""))
        worker_server = replace(server, host="127.0.0.1", port=port, api_key=None)
        command = [*worker_command(worker_engine, worker_server), *stack.worker_args]
        specs.append(WorkerSpec(role, port, command, worker_env(role, api_key, kv_secret, cores),
                                tuple(cores) if cores else None,
                                log_dir / f"{role}-{port}.log" if log_dir else None))
    return specs


class StartupError(RuntimeError):
    """A worker exited, or was not healthy in time, before the stack ever served."""


def wait_healthy(supervisor: Supervisor, timeout: float) -> None:
    """Every worker healthy within `timeout` seconds (they load in parallel: one deadline)."""
    deadline = time.monotonic() + timeout
    for w in supervisor.workers:
        try:
            wait_ready(w.spec.url, w.process, max(0.0, deadline - time.monotonic()))
        except NotReadyError as exc:
            if not exc.exited:
                raise StartupError(f"workers not healthy after {timeout:.0f}s: {w.spec.url}") from None
            log_path = w.spec.log_path
            tail = log_path.read_text()[-3000:] if log_path else "(see the output above)"
            raise StartupError(f"{w.spec.role} worker {w.spec.url} exited with "
                               f"{w.process.returncode} before it was healthy:\n{tail}") from None


def up(stack: UpConfig, engine: EngineConfig, server: ServerConfig, router: RouterConfig,
       worker_command: WorkerCommand) -> int:
    """Start the workers `stack` asks for, each serving `engine` (in its role) and `server` (on
    its own port), then the router `router` in front of them; 1 if startup fails or the
    supervisor gives up, 130 on SIGINT/SIGTERM before the router runs."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # the health polls below are noise
    api_key = stack.worker_api_key or secrets.token_hex(16)
    kv_secret = engine.kv_transfer.secret or secrets.token_hex(16)
    supervisor = Supervisor(worker_specs(stack, engine, server, worker_command, api_key,
                                         kv_secret), stack.supervisor)
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)  # uvicorn installs its own later
    try:
        supervisor.start()
        wait_healthy(supervisor, stack.startup_timeout_seconds)
        signal.signal(signal.SIGTERM, previous)
        urls = {role: tuple(w.spec.url for w in supervisor.workers if w.spec.role == role)
                for role in ("prefill", "decode", "both")}
        return route(replace(router, prefill=urls["prefill"], decode=urls["decode"],
                             workers=urls["both"], worker_api_key=api_key), supervisor)
    except StartupError as exc:
        log.error("hearth up: %s", exc)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        supervisor.stop()


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt

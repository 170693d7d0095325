"""`hearth up`: router + prefill pool + decode pool (+ monolithic workers) on one machine.

Each worker is `python -m hearth.server.launch --role R` on a free loopback port; this process
waits until every worker is healthy, then runs the router itself while a supervisor
(hearth/router/supervisor.py) restarts any worker that exits. Invariants:
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

import argparse
import logging
import os
import secrets
import signal
import socket
import sys
import time
from pathlib import Path

import httpx

from hearth.router.router_config import SupervisorConfig
from hearth.router.supervisor import Supervisor, WorkerSpec

log = logging.getLogger("hearth.up")

# up's own flags that must not be forwarded to workers (the router's, or set per worker here).
# Secrets are never forwarded as flags: workers get theirs in the environment.
_NOT_FORWARDED = {"host", "port", "api_key", "api_key_file", "log_level", "help", "role",
                  "kv_secret", "kv_secret_file", "kv_transport"}


def add_up_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("stack")
    g.add_argument("--prefill", type=int, default=1, help="prefill workers (default: %(default)s)")
    g.add_argument("--decode", type=int, default=1, help="decode workers (default: %(default)s)")
    g.add_argument("--workers", type=int, default=0, help="monolithic workers (role both)")
    g.add_argument("--pin", action="store_true", help="give each worker its own CPU cores")
    try:
        g.add_argument("--kv-transport", default="tcp", help="tcp | mooncake")
    except argparse.ArgumentError:
        pass  # the engine flags already have it (and up passes it on per worker)
    g.add_argument("--worker-arg", action="append", default=[], metavar="FLAG",
                   help="an extra flag for every worker, e.g. --worker-arg=--kv-lease-seconds=10")
    g.add_argument("--worker-api-key", default=None,
                   help="the workers' API key (default: a random one only the router knows; "
                        "visible in ps: prefer $HEARTH_WORKER_API_KEY or --worker-api-key-file)")
    g.add_argument("--worker-api-key-file", default=None, metavar="PATH",
                   help="read the workers' API key from this file")
    g.add_argument("--startup-timeout", type=float, default=300.0)
    g.add_argument("--log-dir", default=None, help="worker logs go here instead of this terminal")
    sup = SupervisorConfig()
    g.add_argument("--max-restarts", type=int, default=sup.max_restarts,
                   help="restarts of one worker within --restart-window before hearth up gives "
                        "up and exits 1 (default: %(default)s)")
    g.add_argument("--restart-window", type=float, default=sup.window_seconds, metavar="SECONDS")
    g.add_argument("--restart-backoff", type=float, default=sup.backoff_seconds, metavar="SECONDS",
                   help="pause before a restart, doubled per restart in the window "
                        f"(default: %(default)s, at most {sup.max_backoff_seconds:g})")


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


def serve_parser() -> argparse.ArgumentParser:
    from hearth.server.launch import add_serve_args

    return add_serve_args(argparse.ArgumentParser(add_help=False))


def forwarded_flags(a: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str]:
    """The engine flags given to `up` that `hearth serve` also takes, as serve flags."""
    flags = []
    for action in parser._actions:  # argparse has no public way to list a parser's options
        dest = action.dest
        if not action.option_strings or dest in _NOT_FORWARDED or not hasattr(a, dest):
            continue
        value = getattr(a, dest)
        if value is None or value == action.default:
            continue
        if isinstance(action, argparse._StoreTrueAction):
            flags.append(action.option_strings[0])
        else:
            flags += [action.option_strings[0], str(value)]
    return flags


def worker_command(a: argparse.Namespace, role: str, port: int,
                   parser: argparse.ArgumentParser) -> list[str]:
    """The worker's argv: no secret in it (they go in `worker_env`)."""
    options = {o for action in parser._actions for o in action.option_strings}
    cmd = [sys.executable, "-m", "hearth.server.launch", "--host", "127.0.0.1", "--port", str(port),
           *forwarded_flags(a, parser)]
    if role != "both":
        if "--role" not in options:
            raise ValueError("this hearth serve has no --role flag: prefill/decode workers are "
                             "not available (use --prefill 0 --decode 0 --workers N)")
        cmd += ["--role", role, "--kv-transport", a.kv_transport]
    if a.block_size != 16 and "--block-size" not in options:
        raise ValueError("hearth serve has no --block-size flag; the router assumes 16")
    return cmd + list(a.worker_arg)


def worker_env(role: str, api_key: str, kv_secret: str, cores: list[int] | None) -> dict[str, str]:
    """The worker's environment: this one's, plus its secrets (hearth/cli.py reads them)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HEARTH_API_KEY": api_key}
    env.pop("HEARTH_WORKER_API_KEY", None)
    if role == "both":
        env.pop("HEARTH_KV_SECRET", None)
    else:
        env["HEARTH_KV_SECRET"] = kv_secret
    if cores:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(len(cores))
    return env


def worker_specs(a: argparse.Namespace, api_key: str, kv_secret: str) -> list[WorkerSpec]:
    roles = ["prefill"] * a.prefill + ["decode"] * a.decode + ["both"] * a.workers
    if not roles or (a.decode == 0 and a.workers == 0):
        raise ValueError("hearth up needs --decode >= 1 or --workers >= 1")
    if a.prefill and not a.decode:
        raise ValueError("--prefill workers need --decode workers to hand their KV to")
    pins = core_sets(len(roles), sorted(os.sched_getaffinity(0))) if a.pin else [None] * len(roles)
    log_dir = Path(a.log_dir) if a.log_dir else None
    if log_dir:
        log_dir.mkdir(parents=True, exist_ok=True)
    parser = serve_parser()
    specs = []
    for role, cores in zip(roles, pins):
        port = free_port()
        specs.append(WorkerSpec(role, port, worker_command(a, role, port, parser),
                                worker_env(role, api_key, kv_secret, cores),
                                tuple(cores) if cores else None,
                                log_dir / f"{role}-{port}.log" if log_dir else None))
    return specs


class StartupError(RuntimeError):
    """A worker exited, or was not healthy in time, before the stack ever served."""


def wait_healthy(supervisor: Supervisor, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    pending = list(supervisor.workers)
    while pending:
        for w in list(pending):
            if w.process.poll() is not None:
                log_path = w.spec.log_path
                tail = log_path.read_text()[-3000:] if log_path else "(see the output above)"
                raise StartupError(f"{w.spec.role} worker {w.spec.url} exited with "
                                   f"{w.process.returncode} before it was healthy:\n{tail}")
            try:
                if httpx.get(w.spec.url + "/health", timeout=2.0).status_code == 200:
                    pending.remove(w)
            except httpx.HTTPError:
                pass
        if time.monotonic() > deadline:
            raise StartupError(f"workers not healthy after {timeout:.0f}s: "
                               f"{[w.spec.url for w in pending]}")
        if pending:
            time.sleep(0.3)


def up_main(a: argparse.Namespace) -> int:
    from hearth.router.launch import router_config, run_router

    logging.getLogger("httpx").setLevel(logging.WARNING)  # the health polls below are noise
    api_key = a.worker_api_key or secrets.token_hex(16)
    kv_secret = a.kv_secret or secrets.token_hex(16)
    config = SupervisorConfig(max_restarts=a.max_restarts, window_seconds=a.restart_window,
                              backoff_seconds=a.restart_backoff)
    supervisor = Supervisor(worker_specs(a, api_key, kv_secret), config)
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)  # uvicorn installs its own later
    try:
        supervisor.start()
        wait_healthy(supervisor, a.startup_timeout)
        signal.signal(signal.SIGTERM, previous)
        urls = {role: [w.spec.url for w in supervisor.workers if w.spec.role == role]
                for role in ("prefill", "decode", "both")}
        router = router_config(a, urls["prefill"], urls["decode"], urls["both"], api_key, a.model)
        return run_router(router, supervisor)
    except StartupError as exc:
        log.error("hearth up: %s", exc)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        supervisor.stop()


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt

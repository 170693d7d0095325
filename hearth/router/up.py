"""`hearth up`: router + prefill pool + decode pool (+ monolithic workers) on one machine.

Each worker is `python -m hearth.server.launch --role R` on a free loopback port; this process
waits until every worker is healthy, then runs the router itself. Invariants:
  * no worker outlives this process: they are terminated on exit, on SIGINT/SIGTERM, when
    startup fails, and (PR_SET_PDEATHSIG) even if this process is killed outright;
  * `--pin` gives every worker its own cores (sched_setaffinity in the child before exec, and
    OMP_NUM_THREADS to match), so one machine stands in for separate prefill and decode
    hardware: with 2 cores and 1 + 1 workers, prefill runs on core 0 and decode on core 1;
  * workers get a random API key and KV secret that only the router knows.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

log = logging.getLogger("hearth.up")

# up's own flags that must not be forwarded to workers (the router's, or set per worker here).
_NOT_FORWARDED = {"host", "port", "api_key", "log_level", "help", "role", "kv_secret", "kv_transport"}


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
                   help="the workers' API key (default: a random one only the router knows)")
    g.add_argument("--startup-timeout", type=float, default=300.0)
    g.add_argument("--log-dir", default=None, help="worker logs go here instead of this terminal")


@dataclass
class WorkerProcess:
    role: str
    url: str
    process: subprocess.Popen
    cores: list[int] | None
    log_path: Path | None


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


def worker_command(a: argparse.Namespace, role: str, port: int, api_key: str, kv_secret: str,
                   parser: argparse.ArgumentParser) -> list[str]:
    options = {o for action in parser._actions for o in action.option_strings}
    cmd = [sys.executable, "-m", "hearth.server.launch", "--host", "127.0.0.1", "--port", str(port),
           "--api-key", api_key, *forwarded_flags(a, parser)]
    if role != "both":
        if "--role" not in options:
            raise ValueError("this hearth serve has no --role flag: prefill/decode workers are "
                             "not available (use --prefill 0 --decode 0 --workers N)")
        cmd += ["--role", role, "--kv-transport", a.kv_transport, "--kv-secret", kv_secret]
    if a.block_size != 16 and "--block-size" not in options:
        raise ValueError("hearth serve has no --block-size flag; the router assumes 16")
    return cmd + list(a.worker_arg)


def _die_with_parent() -> None:
    """In the child: SIGTERM when the parent dies (Linux prctl PR_SET_PDEATHSIG = 1)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    except OSError:
        pass


def spawn(cmd: list[str], role: str, port: int, cores: list[int] | None,
          log_dir: Path | None) -> WorkerProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if cores:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(len(cores))

    def preexec() -> None:
        _die_with_parent()
        if cores:
            os.sched_setaffinity(0, cores)

    log_path = log_dir / f"{role}-{port}.log" if log_dir else None
    out = open(log_path, "w") if log_path else None
    process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT if out else None, env=env,
                               preexec_fn=preexec, start_new_session=True)
    if out:
        out.close()  # the child holds its own descriptor
    log.info("started %s worker pid %d on port %d%s", role, process.pid, port,
             f" (cores {cores})" if cores else "")
    return WorkerProcess(role, f"http://127.0.0.1:{port}", process, cores, log_path)


def wait_healthy(workers: list[WorkerProcess], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    pending = list(workers)
    while pending:
        for w in list(pending):
            if w.process.poll() is not None:
                tail = w.log_path.read_text()[-3000:] if w.log_path else "(see the output above)"
                raise RuntimeError(f"{w.role} worker {w.url} exited with {w.process.returncode}:\n{tail}")
            try:
                if httpx.get(w.url + "/health", timeout=2.0).status_code == 200:
                    pending.remove(w)
            except httpx.HTTPError:
                pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"workers not healthy after {timeout:.0f}s: {[w.url for w in pending]}")
        if pending:
            time.sleep(0.3)


def stop_all(workers: list[WorkerProcess], timeout: float = 20.0) -> None:
    for w in workers:
        if w.process.poll() is None:
            w.process.terminate()
    deadline = time.monotonic() + timeout
    for w in workers:
        try:
            w.process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            w.process.kill()
            w.process.wait()


def _watch(workers: list[WorkerProcess], stopping: threading.Event) -> None:
    """Log a worker that dies while the stack runs (the router ejects it on its own)."""
    reported: set[int] = set()
    while not stopping.wait(1.0):
        for w in workers:
            if w.process.poll() is not None and w.process.pid not in reported:
                reported.add(w.process.pid)
                log.error("%s worker %s exited with %s", w.role, w.url, w.process.returncode)


def start_workers(a: argparse.Namespace, api_key: str, kv_secret: str) -> list[WorkerProcess]:
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
    workers: list[WorkerProcess] = []
    try:
        for role, cores in zip(roles, pins):
            port = free_port()
            cmd = worker_command(a, role, port, api_key, kv_secret, parser)
            workers.append(spawn(cmd, role, port, cores, log_dir))
        wait_healthy(workers, a.startup_timeout)
    except BaseException:
        stop_all(workers)
        raise
    return workers


def up_main(a: argparse.Namespace) -> int:
    from hearth.router.launch import router_config, run_router

    logging.getLogger("httpx").setLevel(logging.WARNING)  # the health polls below are noise
    api_key, kv_secret = a.worker_api_key or secrets.token_hex(16), secrets.token_hex(16)
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)  # uvicorn installs its own later
    workers: list[WorkerProcess] = []
    stopping = threading.Event()
    try:
        workers = start_workers(a, api_key, kv_secret)
        signal.signal(signal.SIGTERM, previous)
        threading.Thread(target=_watch, args=(workers, stopping), daemon=True).start()
        urls = {role: [w.url for w in workers if w.role == role] for role in ("prefill", "decode", "both")}
        config = router_config(a, urls["prefill"], urls["decode"], urls["both"], api_key, a.model)
        return run_router(config)
    except KeyboardInterrupt:
        return 130
    finally:
        stopping.set()
        stop_all(workers)


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt

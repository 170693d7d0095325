"""`hearth up`'s supervisor: the workers it started keep running, each on its own port.

Invariants:
  * a worker that exits while the stack runs is started again with the same command, port and
    environment, so the router re-admits it at the same URL once its `/load` answers; the pause
    before a restart doubles with every restart still inside the window (`SupervisorConfig`);
  * a worker that would need more than `max_restarts` restarts within `window_seconds` is given
    up on: one log line says which and why, `on_give_up` runs (`hearth up` then exits 1);
  * secrets reach a worker through its environment (`WorkerSpec.env`), never its command line,
    which every local user can read in `ps`;
  * once `stop()` begins nothing is started again, and `stop()` ends every worker; no worker
    outlives this process even if it is killed outright (PR_SET_PDEATHSIG in the child);
  * `state()` (the router's /health, which needs no key, shows it) is one snapshot taken under
    the lock, and names workers by role and index: no address, no pid.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from hearth.router.router_config import SupervisorConfig

log = logging.getLogger("hearth.up")

POLL_SECONDS = 0.2  # how often the supervisor looks for exited workers
PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class WorkerSpec:
    """How to start one worker, again and again."""

    role: str  # prefill | decode | both
    port: int  # the HTTP port; a restart binds the same one
    command: list[str]  # argv: never a secret in it
    env: dict[str, str]  # the worker's whole environment, secrets included
    cores: tuple[int, ...] | None = None  # CPU affinity (`--pin`)
    log_path: Path | None = None  # stdout+stderr (appended across restarts); None: the terminal

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class Worker:
    """One supervised worker: its spec, its current process, and its restart record."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.process: subprocess.Popen | None = None
        self.state = "starting"  # starting | running | backoff (restart pending) | failed | stopped
        self.num_restarts = 0
        self.restart_times: deque[float] = deque()  # monotonic times of restarts in the window
        self.restart_at = 0.0
        self.last_exit_code: int | None = None

    def view(self, name: str) -> dict:
        return {"name": name, "role": self.spec.role, "state": self.state,
                "restarts": self.num_restarts, "last_exit_code": self.last_exit_code}


class Supervisor:
    def __init__(self, specs: list[WorkerSpec], config: SupervisorConfig) -> None:
        self.config = config
        self.workers = [Worker(spec) for spec in specs]
        self.gave_up: str | None = None  # why, once a worker kept dying
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._on_give_up: Callable[[], None] = lambda: None
        self._prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved before any fork

    # ---- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        with self._lock:
            for worker in self.workers:
                self._spawn(worker)

    def watch(self, on_give_up: Callable[[], None]) -> None:
        """Supervise from a background thread from now on. Restarted workers are that thread's
        children, and PR_SET_PDEATHSIG fires when the forking *thread* ends: it ends only at
        `stop()` or after giving up, when every worker is being stopped anyway."""
        self._on_give_up = on_give_up
        threading.Thread(target=self._watch, name="hearth-supervisor", daemon=True).start()

    def stop(self, timeout: float = 20.0) -> None:
        with self._lock:
            self._stopping.set()
            running = [w for w in self.workers if w.process is not None]
            for worker in running:
                if worker.process.poll() is None:
                    worker.process.terminate()
                if worker.state != "failed":
                    worker.state = "stopped"
        deadline = time.monotonic() + timeout
        for worker in running:
            try:
                worker.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                worker.process.kill()
                worker.process.wait()

    def state(self) -> dict:
        with self._lock:
            index: dict[str, int] = {}
            views = []
            for worker in self.workers:
                i = index[worker.spec.role] = index.get(worker.spec.role, -1) + 1
                views.append(worker.view(f"{worker.spec.role}-{i}"))
            return {"gave_up": self.gave_up is not None, "workers": views}

    # ---- supervision ------------------------------------------------------------------------

    def _watch(self) -> None:
        while not self._stopping.wait(POLL_SECONDS):
            with self._lock:
                if self._stopping.is_set():
                    return
                now = time.monotonic()
                for worker in self.workers:
                    if worker.state == "running" and worker.process.poll() is not None:
                        self._exited(worker, now)
                    elif worker.state == "backoff" and now >= worker.restart_at:
                        self._restart(worker, now)
            if self.gave_up is not None:
                self._on_give_up()
                return

    def _exited(self, worker: Worker, now: float) -> None:
        spec, config = worker.spec, self.config
        worker.last_exit_code = worker.process.returncode
        while worker.restart_times and now - worker.restart_times[0] > config.window_seconds:
            worker.restart_times.popleft()
        if len(worker.restart_times) >= config.max_restarts:
            worker.state = "failed"
            self.gave_up = (f"{spec.role} worker {spec.url} exited with {worker.last_exit_code} "
                            f"after {len(worker.restart_times)} restarts within "
                            f"{config.window_seconds:.0f}s")
            log.error("giving up: %s; stopping hearth up", self.gave_up)
            return
        delay = min(config.max_backoff_seconds,
                    config.backoff_seconds * 2 ** len(worker.restart_times))
        worker.state, worker.restart_at = "backoff", now + delay
        log.error("%s worker %s (pid %d) exited with %s; restarting it in %.1fs (%d of at most %d "
                  "restarts within %.0fs)", spec.role, spec.url, worker.process.pid,
                  worker.last_exit_code, delay, len(worker.restart_times) + 1, config.max_restarts,
                  config.window_seconds)

    def _restart(self, worker: Worker, now: float) -> None:
        worker.restart_times.append(now)
        worker.num_restarts += 1
        self._spawn(worker)
        log.warning("restarted %s worker %s: pid %d (restart %d)", worker.spec.role,
                    worker.spec.url, worker.process.pid, worker.num_restarts)

    def _spawn(self, worker: Worker) -> None:
        spec, parent, prctl = worker.spec, os.getpid(), self._prctl

        def preexec() -> None:  # in the child, before exec: no imports, no allocation-heavy work
            prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
            if os.getppid() != parent:  # the parent died before prctl took effect
                os._exit(1)
            if spec.cores:
                os.sched_setaffinity(0, spec.cores)

        out = open(spec.log_path, "a") if spec.log_path else None
        try:
            worker.process = subprocess.Popen(
                spec.command, stdout=out, stderr=subprocess.STDOUT if out else None, env=spec.env,
                preexec_fn=preexec, start_new_session=True)
        finally:
            if out:
                out.close()  # the child holds its own descriptor
        worker.state = "running"
        log.info("started %s worker pid %d on port %d%s", spec.role, worker.process.pid, spec.port,
                 f" (cores {list(spec.cores)})" if spec.cores else "")

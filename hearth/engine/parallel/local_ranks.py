"""Rank processes 1..W-1 that the driver spawns on its own machine, and their watchdog.

The watchdog polls the children every 0.2 s: a child that exits while the rank set is running is
reported at once (with its exit code), which is quicker and more precise than the heartbeat.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from typing import Callable

import msgspec

from hearth.engine.parallel.distributed import RankFailedError, RankLayout
from hearth.engine.parallel.rank import RankSpec

log = logging.getLogger("hearth.executor")


class LocalRanks:
    def __init__(self, specs: list[RankSpec], layout: RankLayout,
                 on_death: Callable[[str], None]) -> None:
        self.layout = layout
        self.on_death = on_death
        self.procs: dict[int, subprocess.Popen] = {}
        for spec in specs:
            argv = [sys.executable, "-m", "hearth.engine.parallel.rank",
                    msgspec.json.encode(spec).decode()]
            self.procs[spec.rank] = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="hearth-rank-watchdog",
                                        daemon=True)
        self._thread.start()

    @property
    def pids(self) -> dict[int, int]:
        return {rank: p.pid for rank, p in self.procs.items()}

    def dead(self) -> list[str]:
        """'rank r (...) died (exit code c)' for every child that has exited."""
        return [f"{self.layout.describe(rank)} died (exit code {p.returncode})"
                for rank, p in self.procs.items() if p.poll() is not None]

    def _watch(self) -> None:
        while not self._stop.wait(0.2):
            dead = self.dead()
            if dead and not self._stop.is_set():
                self.on_death("; ".join(dead))
                return

    def wait_joined(self, store, timeout_s: float) -> None:
        """Wait until every child reached the store, failing fast if one dies on the way
        (a broken environment, an import error) instead of waiting out the timeout."""
        keys = [f"hearth/joined/{rank}" for rank in self.procs]
        deadline = time.monotonic() + timeout_s
        while not store.check(keys):
            dead = self.dead()
            if dead:
                raise RankFailedError(f"while starting: {'; '.join(dead)}")
            if time.monotonic() > deadline:
                raise RankFailedError(f"rank processes did not start within {timeout_s:.0f}s")
            time.sleep(0.05)

    def stop_watching(self) -> None:
        self._stop.set()

    def close(self, grace_s: float = 5.0) -> None:
        """Wait for the children to exit (after SHUTDOWN), then kill whatever is left."""
        self.stop_watching()
        deadline = time.monotonic() + grace_s
        for p in self.procs.values():
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def kill(self) -> None:
        self.stop_watching()
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
        for p in self.procs.values():
            p.wait()

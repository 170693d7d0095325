"""Waiting for a freshly started server to serve: the one poll loop that `hearth up`, the
benchmarks and the e2e tests use.

A server is ready when one of `paths` answers 200 (hearth's `/health` does once the model is
loaded; a peer server without `/health` is probed on `/v1/models`). A process that exits first
is a `NotReadyError` at once, not after the timeout; so is a timeout. The caller owns the
process: this never kills it.
"""

from __future__ import annotations

import subprocess
import time

import httpx

POLL_SECONDS = 0.1


class NotReadyError(RuntimeError):
    def __init__(self, message: str, exited: bool) -> None:
        super().__init__(message)
        self.exited = exited  # the process ended (else: still not ready at the deadline)


def answers(url: str, paths: tuple[str, ...] = ("/health",)) -> bool:
    """Whether any of `paths` answers 200 now (a fresh connection per probe)."""
    for path in paths:
        try:
            with httpx.Client(timeout=2, limits=httpx.Limits(max_keepalive_connections=0)) as client:
                if client.get(url + path).status_code == 200:
                    return True
        except httpx.HTTPError:
            pass
    return False


def wait_ready(url: str, process: subprocess.Popen | None, timeout: float,
               paths: tuple[str, ...] = ("/health",)) -> float:
    """Seconds until `url` answered; NotReadyError if `process` exited or `timeout` passed."""
    start = time.monotonic()
    while True:
        if process is not None and process.poll() is not None:
            raise NotReadyError(f"{url}: the process exited with {process.returncode} before it "
                                f"was ready", exited=True)
        if answers(url, paths):
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            raise NotReadyError(f"{url}: not ready after {timeout:.0f}s", exited=False)
        time.sleep(POLL_SECONDS)

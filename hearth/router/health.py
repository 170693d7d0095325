"""Active health checks: poll every endpoint's `/load`, which also corrects the load estimates
and the cache views.

What takes an endpoint out, and what does not:
  * out at once: a refused or reset connection, a connect timeout, or a non-200 answer (a worker
    answers 503 while its model loads or after its engine died);
  * never out: a slow answer. A worker answers /load between engine steps, so under load (or a
    saturated CPU) a poll can take seconds while requests still flow. A poll past
    `HealthConfig.timeout_seconds` only marks the load report stale (`num_slow_checks`) and backs
    the poll interval off; requests in flight are untouched. A worker that is wedged for real is
    taken out by the request path's own failures (`Endpoint.mark_failed`), and is not re-admitted
    until a poll answers again.
A passively ejected endpoint (a hop failed on it) is not re-admitted before its ejection pause is
over, even if `/load` answers, so a flapping worker cannot take every retry. A worker whose
`/load` answers but is not a `LoadReport`, or reports another KV block size than the router's,
is kept out too (the reason is in the router's /load view). The first successful check also
learns the served model name.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import httpx

from hearth.router.endpoints import Endpoint, EndpointPool
from hearth.router.router_config import HealthConfig
from hearth.api.load_report import LoadReport, decode_load_report

log = logging.getLogger("hearth.router.health")

CONNECT_TIMEOUT = 1.0  # a live worker on the network accepts at once; refused or silent: down


@dataclass
class ModelInfo:
    """What the workers serve, learned from the first healthy one's /v1/models."""

    name: str | None = None  # the workers' primary name (what they expect as `model`)
    max_model_len: int | None = None
    names: tuple[str, ...] = ()  # every name the workers answer to (their aliases too)


class HealthChecker:
    def __init__(self, pool: EndpointPool, client: httpx.AsyncClient, config: HealthConfig,
                 worker_api_key: str | None, model: ModelInfo, block_size: int) -> None:
        self.pool, self.client, self.config, self.model = pool, client, config, model
        self.block_size = block_size  # the router's (PolicyConfig.block_size)
        self.timeout = httpx.Timeout(config.timeout_seconds, connect=CONNECT_TIMEOUT)
        self.headers = {"Authorization": f"Bearer {worker_api_key}"} if worker_api_key else {}
        self._loops: dict[str, asyncio.Task] | None = None  # per endpoint, while run() runs

    async def check(self, endpoint: Endpoint) -> None:
        own = (endpoint.own_prefill_tokens, endpoint.own_decode_tokens)
        try:
            response = await self.client.get(
                endpoint.url + "/load", params={"events_since": endpoint.events_cursor},
                headers=self.headers, timeout=self.timeout)
            report = decode_load_report(response.content) if response.status_code == 200 else None
            error = None if report is not None else f"/load answered {response.status_code}"
        except httpx.ConnectTimeout:
            report, error = None, "connect timeout"
        except httpx.TimeoutException:
            self._slow(endpoint)
            return
        except (httpx.HTTPError, ValueError) as exc:
            report, error = None, f"{type(exc).__name__}: {exc}"
        if report is None:
            self._down(endpoint, error)
            return
        if endpoint.num_slow_checks:
            log.info("endpoint %s answers /load again after %d slow polls", endpoint.url,
                     endpoint.num_slow_checks)
        endpoint.num_slow_checks = 0
        if self._refuse(endpoint, report):
            return
        endpoint.apply_report(report, own)
        if not endpoint.healthy and time.monotonic() >= endpoint.ejected_until:
            log.info("endpoint %s (%s) is healthy", endpoint.url, endpoint.role)
            endpoint.healthy, endpoint.last_error = True, None
        if self.model.name is None:
            await self._learn_model(endpoint)

    def _refuse(self, endpoint: Endpoint, report: LoadReport) -> bool:
        """Whether the worker answers but breaks the contract with this router: its KV blocks
        hold another number of tokens than the router hashes per block, so no prefix would
        ever match (cache-aware routing silently off). Such an endpoint is kept out until a
        report agrees again (a restarted worker), with the reason in /load and the log."""
        if report.block_size == self.block_size:
            if endpoint.refusal is not None:
                log.info("endpoint %s: block size now %d, as the router's; admitting it",
                         endpoint.url, report.block_size)
                endpoint.refusal = None
            return False
        refusal = (f"refused: its KV block size is {report.block_size} tokens, the router's is "
                   f"{self.block_size} (--block-size must be the same on router and workers)")
        if endpoint.refusal != refusal:
            log.error("endpoint %s %s", endpoint.url, refusal)
        endpoint.refusal = refusal
        self._down(endpoint, refusal)
        return True

    def _slow(self, endpoint: Endpoint) -> None:
        """A stale load report, not a dead worker: keep the endpoint as it is, poll less often."""
        endpoint.num_slow_checks += 1
        if endpoint.num_slow_checks == 1:
            log.warning("endpoint %s: /load slower than %.1fs; keeping it (load report stale), "
                        "polling it less often", endpoint.url, self.config.timeout_seconds)

    def poll_interval(self, endpoint: Endpoint) -> float:
        """The pause before the next poll: doubled per slow poll in a row, capped."""
        backoff = 2.0 ** min(endpoint.num_slow_checks, 16)
        return min(self.config.interval_seconds * backoff,
                   max(self.config.interval_seconds, self.config.max_interval_seconds))

    def _down(self, endpoint: Endpoint, error: str | None) -> None:
        if endpoint.healthy:
            log.warning("endpoint %s is down (%s)", endpoint.url, error)
        endpoint.healthy = False
        endpoint.last_error = error

    async def _learn_model(self, endpoint: Endpoint) -> None:
        try:
            response = await self.client.get(endpoint.url + "/v1/models", headers=self.headers,
                                             timeout=5.0)
            entry = response.json()["data"][0]
            self.model.max_model_len = entry.get("max_model_len")
            self.model.names = tuple(e["id"] for e in response.json()["data"])
            self.model.name = entry["id"]
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
            pass

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(e) for e in self.pool))

    async def run(self) -> None:
        """One loop per endpoint, so a slow worker never delays the checks of the others;
        endpoints that discovery adds later get theirs from `endpoints_changed`."""
        self._loops: dict[str, asyncio.Task] = {}
        self.endpoints_changed(list(self.pool), [])
        try:
            await asyncio.Event().wait()  # until cancelled
        finally:
            for task in self._loops.values():
                task.cancel()

    def endpoints_changed(self, added: list[Endpoint], removed: list[Endpoint]) -> None:
        """(discovery) Start polling new endpoints, stop polling removed ones."""
        loops = self._loops
        if loops is None:  # run() has not started: it starts a loop for every endpoint
            return
        for endpoint in removed:
            task = loops.pop(endpoint.url, None)
            if task is not None:
                task.cancel()
        for endpoint in added:
            if endpoint.url not in loops:
                loops[endpoint.url] = asyncio.get_running_loop().create_task(
                    self._loop(endpoint), name=f"router-health-{endpoint.url}")

    async def _loop(self, endpoint: Endpoint) -> None:
        while True:
            await self.check(endpoint)
            await asyncio.sleep(self.poll_interval(endpoint))

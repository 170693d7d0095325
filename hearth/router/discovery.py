"""Discovery: the router learns its workers from a registry instead of command-line URLs.

A `Registry` (the protocol below) is anything that lists the workers that exist now, with a
version that changes whenever the list does; hearth's cluster deployment implements it over a
named Ray actor (hearth/cluster/worker_registry.py), and tests over a plain object. The router runs a
`DiscoveryLoop` beside its health checks:

  * every `interval` seconds it reads the registry's version; when it changed it reads the
    records, makes the endpoint pool match them (`EndpointPool.reconcile`: new workers start
    unhealthy until their first `/load` answers, so the health checks stay the source of truth
    for routing; removed workers leave every choice at once) and starts or stops their health
    loops;
  * every round it acknowledges the version it applied, reports the requests it has open per
    worker and names the workers it routes to (healthy, not draining): `hearth scale --wait`
    returns only once the router routes to every running worker, not merely once they run. That is how a drain knows it is safe: the controller marks a worker draining, waits
    until the router acknowledged a version that includes the mark, then until the router has
    no request open there, and only then stops it (hearth/cluster/controller.py);
  * a registry that cannot be read (the cluster is restarting) leaves the pool as it was: the
    workers already known keep serving, and the error is logged once per outage.

Registry calls block (a Ray round trip), so they run on a worker thread, never the event loop.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Callable, Protocol

from hearth.router.endpoints import EndpointPool

log = logging.getLogger("hearth.router.discovery")


@dataclass(frozen=True)
class WorkerRecord:
    """One worker as the registry lists it."""

    name: str  # unique within the deployment, e.g. "decode-3"
    role: str  # prefill | decode | both
    url: str  # where its HTTP server answers (its node's address)
    draining: bool = False  # finishing its requests; the router sends it no new one
    node: str = ""  # the cluster node it runs on (shown in /load)


class Registry(Protocol):
    def version(self) -> int: ...

    def records(self) -> tuple[int, list[WorkerRecord]]: ...

    def acknowledge(self, version: int, in_flight: dict[str, int],
                    healthy: list[str]) -> None: ...


class DiscoveryLoop:
    def __init__(self, registry: Registry, pool: EndpointPool, interval: float,
                 on_change: Callable[[list, list], None]) -> None:
        self.registry, self.pool, self.interval = registry, pool, interval
        self.on_change = on_change  # (added, removed) endpoints: the health checker's hook
        self.applied = -1  # the registry version the pool matches
        self._failing = False

    async def poll_once(self) -> bool:
        """One round; True if the pool changed."""
        changed = False
        try:
            version = await asyncio.to_thread(self.registry.version)
            if version != self.applied:
                version, records = await asyncio.to_thread(self.registry.records)
                added, removed = self.pool.reconcile(records)
                if added or removed:
                    changed = True
                    self.on_change(added, removed)
                    for endpoint in added:
                        log.info("discovered %s worker %s at %s", endpoint.role.value,
                                 endpoint.name, endpoint.url)
                    for endpoint in removed:
                        log.info("worker %s at %s left", endpoint.name, endpoint.url)
                self.applied = version
            await asyncio.to_thread(self.registry.acknowledge, self.applied,
                                    self.pool.in_flight(), self.pool.healthy_names())
            if self._failing:
                log.info("the worker registry answers again")
                self._failing = False
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - any registry failure: keep what we have
            if not self._failing:
                log.warning("cannot read the worker registry (%s: %s); keeping the %d known "
                            "workers", type(exc).__name__, exc, len(self.pool.endpoints))
            self._failing = True
        return changed

    async def run(self) -> None:
        while True:
            await self.poll_once()
            await asyncio.sleep(self.interval)

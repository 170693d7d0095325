"""The deployment's registry: one named Ray actor that every part of a cluster deployment meets at.

`WorkerRegistry` (made a Ray actor by `registry_actor()`, named `<deployment>-registry` in the
`hearth` namespace, owned by the `hearth up --cluster` process so it ends with it) holds:

  * the workers that serve now (name, role, URL, node, draining), with a version that changes
    on every change: a worker registers itself once it is healthy, the controller removes it
    when it is gone and marks it draining before a scale-down;
  * the targets (workers per role) the controller scales to: `hearth scale` sets them;
  * the router's acknowledgement: the last version it applied and the requests it has open per
    worker URL (hearth/router/discovery.py), which is what lets a drain finish safely, and the
    workers it routes to (status()'s "router"), which is what `hearth scale --wait` waits for;
  * the secrets (the workers' API key and the KV-transfer secret). Workers fetch them with a
    method call when they start, so they never appear on a command line, in an environment that
    Ray shows (runtime_env), or in an actor's constructor arguments.

`RayRegistry` is the router's side (the `Registry` protocol of hearth/router/discovery.py).
Only this package imports Ray.
"""

from __future__ import annotations

import time

from hearth.cluster.cluster_config import ROLES
from hearth.router.discovery import WorkerRecord


class WorkerRegistry:
    """Plain state with small methods; Ray runs one call at a time (no locks needed)."""

    def __init__(self, deployment: str) -> None:
        self.deployment = deployment
        self._version = 0
        self._workers: dict[str, dict] = {}
        self._targets: dict[str, int] = {role: 0 for role in ROLES}
        self._ack_version = -1
        self._in_flight: dict[str, int] = {}
        self._ack_time = 0.0
        self._routed: list[str] = []  # the workers the router last said it routes to
        self._secrets: dict[str, str] = {}
        self._status: dict = {}

    # ---- workers ----------------------------------------------------------------------------
    def version(self) -> int:
        return self._version

    def records(self) -> tuple[int, list[dict]]:
        return self._version, [dict(w) for w in self._workers.values()]

    def register(self, name: str, role: str, url: str, node: str) -> int:
        self._workers[name] = dict(name=name, role=role, url=url, node=node, draining=False)
        self._version += 1
        return self._version

    def deregister(self, name: str) -> int:
        if self._workers.pop(name, None) is not None:
            self._version += 1
        return self._version

    def set_draining(self, name: str) -> int:
        worker = self._workers.get(name)
        if worker is not None and not worker["draining"]:
            worker["draining"] = True
            self._version += 1
        return self._version

    # ---- the router's acknowledgement -------------------------------------------------------
    def acknowledge(self, version: int, in_flight: dict[str, int],
                    healthy: list[str] = ()) -> None:
        self._ack_version, self._in_flight, self._ack_time = version, dict(in_flight), time.time()
        self._routed = sorted(healthy)

    def router_view(self) -> tuple[int, dict[str, int], float]:
        return self._ack_version, dict(self._in_flight), self._ack_time

    # ---- targets and status -----------------------------------------------------------------
    def set_targets(self, targets: dict[str, int]) -> dict[str, int]:
        for role, count in targets.items():
            if role not in ROLES:
                raise ValueError(f"unknown role {role!r} (roles: {', '.join(ROLES)})")
            if not isinstance(count, int) or count < 0:
                raise ValueError(f"{role}: {count!r} workers (must be an integer >= 0)")
        merged = {**self._targets, **targets}
        if merged["decode"] == 0 and merged["both"] == 0:
            raise ValueError("a deployment needs at least one decode or monolithic worker")
        if merged["prefill"] and not merged["decode"]:
            raise ValueError("prefill workers need decode workers to hand their KV to")
        self._targets = merged
        return dict(self._targets)

    def targets(self) -> dict[str, int]:
        return dict(self._targets)

    def set_target_if(self, role: str, expected: int, count: int) -> bool:
        """Set one role's target only if it still is `expected` (the autoscaler's move: a
        `hearth scale` that came in between wins). False if it changed meanwhile."""
        if self._targets.get(role) != expected:
            return False
        self.set_targets({role: count})
        return True

    def decrement_target(self, role: str) -> dict[str, int]:
        """One worker fewer wanted for `role` (a dead worker not replaced: --no-replace). One
        actor call, so a concurrent `hearth scale` is never undone by a stale read. May leave
        a role at 0 that a deployment needs: the worker is gone either way."""
        self._targets[role] = max(0, self._targets[role] - 1)
        return dict(self._targets)

    def set_status(self, status: dict) -> None:
        self._status = status

    def status(self) -> dict:
        """What `hearth scale` prints: targets, the controller's view of each worker."""
        return {"deployment": self.deployment, "targets": dict(self._targets),
                "version": self._version, **self._status,
                "router": {"applied": self._ack_version, "routes_to": list(self._routed)}}

    # ---- secrets ----------------------------------------------------------------------------
    def set_secrets(self, secrets: dict[str, str]) -> None:
        self._secrets = dict(secrets)

    def secrets(self) -> dict[str, str]:
        return dict(self._secrets)


def registry_actor():
    """WorkerRegistry as a Ray actor class (Ray imported only here and when this is called)."""
    import ray

    return ray.remote(num_cpus=0, max_restarts=0)(WorkerRegistry)


class RayRegistry:
    """The router's view of the registry actor (hearth/router/discovery.py's `Registry`)."""

    TIMEOUT = 10.0

    def __init__(self, handle) -> None:
        self.handle = handle

    def version(self) -> int:
        import ray

        return ray.get(self.handle.version.remote(), timeout=self.TIMEOUT)

    def records(self) -> tuple[int, list[WorkerRecord]]:
        import ray

        version, records = ray.get(self.handle.records.remote(), timeout=self.TIMEOUT)
        return version, [WorkerRecord(**r) for r in records]

    def acknowledge(self, version: int, in_flight: dict[str, int],
                    healthy: list[str]) -> None:
        import ray

        ray.get(self.handle.acknowledge.remote(version, in_flight, healthy),
                timeout=self.TIMEOUT)

"""The controller of a cluster deployment: the workers the registry's targets ask for, on Ray.

One thread in the `hearth up --cluster` process reconciles every `interval_seconds`:

  * placement: each worker gets its own placement group, one bundle per pipeline stage of T
    ranks' resources (`cpus_per_rank` x T logical CPUs, GPUs, memory; the stages placed by
    `stage_strategy`, so P > 1 stages may span nodes), each bundle on one node (a stage's
    ranks share its node's memory), and a `WorkerProcess` actor scheduled into it. A group Ray
    cannot place yet (no node has room) waits; the worker counts as starting meanwhile;
  * scaling: fewer live workers of a role than its target: start more; more: drain the newest.
    A drain marks the worker draining in the registry, waits until the router acknowledged that
    version (it then sends the worker nothing new) and has no request open there, then stops
    it (SIGTERM) — so a scale-down loses no request. `drain_timeout_seconds` bounds the wait;
  * failures: a worker whose process exits, or whose actor or node is gone, leaves the registry
    at once (the router drops it, and its in-flight streams continue elsewhere: the router's
    resume) and, while its role's target still wants it, is replaced on whatever node has room.
    More than `max_failures` deaths or failed starts within `failure_window_seconds`: the
    controller gives up (`gave_up`, and `hearth up --cluster` exits 1);
  * autoscaling (optional, hearth/cluster/autoscaler.py): an autoscaled role's target follows
    the requests the router reports open on its workers; the target moves, and the scaling
    above (drains included) does the rest;
  * KV peers: every worker's `--kv-peers-file` lists the cluster's alive nodes; when the node
    set changes (a node joins or leaves) each worker's file is rewritten (`set_peers`), and a
    decode worker reads it again before its next pull, so prefill workers on a node that joined
    later are trusted without restarting anyone;
  * cleanup: a worker that ends leaves no actor and no placement group behind; `stop()` ends
    every worker, then the registry.
The router is the source of truth for routing (its health checks); this is the source of truth
for which workers exist.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable
from urllib.parse import urlsplit

from hearth.cluster.autoscaler import Autoscaler, open_requests_by_role
from hearth.cluster.cluster_config import ClusterConfig
from hearth.cluster.worker_registry import ROLES, registry_actor
from hearth.cluster.worker_actor import ServeArgv, worker_actor_class
from hearth.config import EngineConfig
from hearth.server.server_config import ServerConfig

log = logging.getLogger("hearth.cluster")

HEAD_RESOURCE = "node:__internal_head__"  # every Ray cluster's head node has one of it
PEER_SYNC_SECONDS = 1.0  # how often the alive nodes are compared with the workers' peers
ROUTER_VIEW_MAX_AGE_SECONDS = 5.0  # an older acknowledgement: the router's load is unknown


@dataclass
class Worker:
    name: str
    role: str
    actor: object
    group: object  # its placement group
    started: float
    state: str = "placing"  # placing | starting | running | draining | stopping
    # The group's one readiness ref, made once: a fresh `group.ready()` per poll is an async
    # GCS wait that `ray.wait(timeout=0)` checks before its reply can land, so a worker could
    # sit "placing" for a minute or more on an idle cluster (seen: 4-60 s, and never in a loop
    # that polled every 0.2 s).
    ready_ref: object = None
    start_ref: object = None
    wait_ref: object = None
    stop_ref: object = None
    record: dict = field(default_factory=dict)
    drain_version: int = -1
    drain_since: float = 0.0
    peers: frozenset[str] = frozenset()  # the node addresses its KV import may connect to

    def view(self) -> dict:
        return {"name": self.name, "role": self.role, "state": self.state,
                "node": self.record.get("node", "")[:12]}

    @property
    def host(self) -> str | None:
        return urlsplit(self.record["url"]).hostname if self.record else None

    def detail(self) -> dict:
        """`view()` plus addresses: for the registry's status (`hearth scale`), not /health."""
        return {**self.view(), "host": self.host, "kv_peers": sorted(self.peers),
                "log": self.record.get("log"), "peers_file": self.record.get("peers_file"),
                "stage_nodes": self.record.get("stage_nodes") or [],
                "rank_pids": self.record.get("rank_pids") or {}}


class Controller:
    def __init__(self, cluster: ClusterConfig, engine: EngineConfig, server: ServerConfig,
                 worker_args: tuple[str, ...], targets: dict[str, int], serve_argv: ServeArgv,
                 log_dir: str | None = None) -> None:
        self.cluster, self.engine, self.server = cluster, engine, server
        self.serve_argv = serve_argv  # configs -> `hearth serve` flags (hearth/flags/'s)
        self.log_dir = log_dir
        self.worker_args = worker_args
        self.initial_targets = targets
        self.workers: dict[str, Worker] = {}
        self.registry = None
        self.gave_up: str | None = None
        self.failures: deque[float] = deque()
        self.num_replaced = 0
        self._ids = itertools.count()
        self._nodes: tuple[str, ...] = ()  # the alive nodes' addresses the workers were told
        self._next_peer_sync = 0.0
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._stop_router: Callable[[], None] = lambda: None
        self._lock = threading.Lock()
        self.autoscaler = Autoscaler(cluster.autoscale) if cluster.autoscale.ranges else None

    # ---- lifecycle --------------------------------------------------------------------------
    def start(self, secrets: dict[str, str]) -> None:
        """Create the registry (fails if this deployment already runs) and the first workers."""
        import ray

        try:
            ray.get_actor(self.cluster.registry_name, namespace=self.cluster.namespace)
        except ValueError:
            pass
        else:
            raise RuntimeError(f"a deployment named {self.cluster.name!r} already runs on this "
                               "cluster (hearth scale changes it; --cluster-name starts another)")
        # On the head node (Ray gives it this resource): the registry must not be lost with a
        # worker node, and a cluster that loses its head is gone anyway.
        self.registry = registry_actor().options(
            name=self.cluster.registry_name, namespace=self.cluster.namespace,
            resources={HEAD_RESOURCE: 0.001}).remote(self.cluster.name)
        ray.get(self.registry.set_secrets.remote(secrets))
        ray.get(self.registry.set_targets.remote(self.initial_targets))
        self.reconcile()

    def watch(self, on_give_up: Callable[[], None]) -> None:
        """Reconcile from a background thread from now on (the `supervisor` hook of route());
        `on_give_up` stops the router (`stop_router()` calls it too)."""
        self._stop_router = on_give_up
        self._thread = threading.Thread(target=self._loop, name="hearth-cluster", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stopping.wait(self.cluster.interval_seconds):
            try:
                self.reconcile()
            except Exception:  # noqa: BLE001 - a Ray hiccup must not end supervision
                log.exception("cluster reconcile failed; retrying")
            if self.gave_up is not None:
                self._stop_router()
                return

    def stop_router(self) -> None:
        """End the router this controller watches over (route() returns)."""
        self._stop_router()

    def wait_ready(self, timeout: float) -> None:
        """Until every initial worker serves (reconciling meanwhile); RuntimeError if the
        deployment gave up or `timeout` passed."""
        deadline = time.monotonic() + timeout
        while True:
            self.reconcile()
            if self.gave_up is not None:
                raise RuntimeError(self.gave_up)
            running = sum(w.state == "running" for w in self.workers.values())
            if running >= sum(self.initial_targets.values()):
                return
            if time.monotonic() > deadline:
                pending = [w.view() for w in self.workers.values() if w.state != "running"]
                raise RuntimeError(f"workers not serving after {timeout:.0f}s: {pending} (does "
                                   "the cluster have room? `ray status` shows its resources)")
            time.sleep(self.cluster.interval_seconds)

    def stop(self) -> None:
        import ray

        self._stopping.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)
        with self._lock:
            refs = [w.actor.stop.remote() for w in self.workers.values()]
            try:
                ray.get(refs, timeout=30)
            except Exception:  # noqa: BLE001 - dead actors, a lost node: kill below anyway
                pass
            for worker in list(self.workers.values()):
                self._remove(worker)
            if self.registry is not None:
                ray.kill(self.registry)
                self.registry = None

    def state(self, detail: bool = False) -> dict:
        """For the router's /health: the deployment's workers by name, role and state (with
        `detail`, for the registry's status: their hosts and KV peers too)."""
        views = [w.detail() if detail else w.view() for w in list(self.workers.values())]
        return {"gave_up": self.gave_up is not None, "replaced": self.num_replaced,
                "workers": views}

    # ---- one round --------------------------------------------------------------------------
    def reconcile(self) -> None:
        import ray

        with self._lock:
            if self.registry is None or self._stopping.is_set():
                return
            self._collect(ray)
            targets = ray.get(self.registry.targets.remote())
            router_view = ray.get(self.registry.router_view.remote())
            if self.autoscaler is not None:
                self._autoscale(ray, targets, router_view)
            wanted = []
            for role in ROLES:
                live = [w for w in self.workers.values() if w.role == role
                        and w.state in ("placing", "starting", "running")]
                wanted += [role] * (targets.get(role, 0) - len(live))
                extra = len(live) - targets.get(role, 0)
                if extra > 0:  # newest first: those still starting go before serving ones
                    for worker in sorted(live, key=lambda w: (w.state == "running", -w.started))[:extra]:
                        self._drain(worker)
            # The largest placement groups first: small ones spread over the nodes first
            # could leave no node with room for a worker of many ranks.
            for role in sorted(wanted, key=lambda r: -self._num_ranks(r)):
                self._add(role)
            self._sync_peers()
            self._progress_drains(router_view)
            ray.get(self.registry.set_status.remote(self.state(detail=True)))

    def _autoscale(self, ray, targets: dict[str, int], router_view) -> None:
        """Move each autoscaled role's target (in `targets` too) as the router's load asks."""
        _, in_flight, ack_time = router_view
        fresh = time.time() - ack_time < ROUTER_VIEW_MAX_AGE_SECONDS
        num_open = open_requests_by_role(
            in_flight, {w.record["url"]: w.role for w in self.workers.values() if w.record})
        for role in self.cluster.autoscale.ranges:
            if not fresh:
                self.autoscaler.forget(role)
                continue
            new = self.autoscaler.decide(role, targets[role], num_open[role], time.monotonic())
            if new == targets[role]:
                continue
            try:
                moved = ray.get(self.registry.set_target_if.remote(role, targets[role], new))
            except ray.exceptions.RayTaskError as exc:  # e.g. prefill without decode workers
                log.warning("autoscale: %s %d -> %d refused: %s", role, targets[role], new,
                            _reason(exc))
                continue
            if moved:
                log.info("autoscale: %s workers %d -> %d (%d requests open)", role,
                         targets[role], new, num_open[role])
                targets[role] = new

    def _collect(self, ray) -> None:
        """Starts that finished, workers that ended."""
        for worker in list(self.workers.values()):
            if worker.state == "placing":
                if worker.ready_ref is None:
                    worker.ready_ref = worker.group.ready()
                ready, _ = ray.wait([worker.ready_ref], timeout=0)
                if ready:
                    worker.state = "starting"
                    worker.start_ref = worker.actor.start.remote(self.cluster.start_timeout_seconds)
                    worker.wait_ref = worker.actor.wait.remote()
                elif time.monotonic() - worker.started > self.cluster.start_timeout_seconds:
                    self._failed(worker, "its placement group could not be placed in "
                                         f"{self.cluster.start_timeout_seconds:.0f}s")
                continue
            if worker.state == "starting":
                done, _ = ray.wait([worker.start_ref], timeout=0)
                if done:
                    try:
                        worker.record = ray.get(worker.start_ref)
                        worker.state = "running"
                        log.info("worker %s (%s) serves at %s on node %s", worker.name,
                                 worker.role, worker.record["url"], worker.record["node"][:12])
                    except Exception as exc:  # noqa: BLE001 - start failed or actor died
                        self._failed(worker, f"did not start: {_reason(exc)}")
                        continue
            if worker.wait_ref is not None and worker.state in ("running", "draining", "stopping"):
                done, _ = ray.wait([worker.wait_ref], timeout=0)
                if done:
                    try:
                        why = f"its process exited with {ray.get(worker.wait_ref)}"
                    except Exception as exc:  # noqa: BLE001 - the actor or its node is gone
                        why = f"its actor is gone ({_reason(exc)})"
                    if worker.state == "stopping":
                        log.info("worker %s stopped (%s)", worker.name, why)
                        self._remove(worker)
                    else:
                        self._failed(worker, why)

    def _add(self, role: str) -> Worker:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        name = f"{role}-{next(self._ids)}"
        engine = self._engine_for(role)
        ranks = self._num_ranks(role)
        stages = engine.parallel.pipeline_parallel_size
        per_stage = ranks // stages  # T ranks, on one node
        bundle = {"CPU": self.cluster.cpus_per_rank * per_stage}
        if self.cluster.gpus_per_rank:
            bundle["GPU"] = self.cluster.gpus_per_rank * per_stage
        if self.cluster.memory_per_rank_bytes:
            bundle["memory"] = self.cluster.memory_per_rank_bytes * per_stage
        bundle = {k: v for k, v in bundle.items() if v} or {"CPU": 0.001}
        # One bundle per pipeline stage: a stage's ranks share a node; stages may not (the
        # rank set meets over the network, hearth/cluster/worker_actor.py).
        group = placement_group([bundle] * stages,
                                strategy="STRICT_PACK" if stages == 1 else self.cluster.stage_strategy,
                                name=f"{self.cluster.name}-{name}")
        peers = self._nodes or _cluster_peers()
        actor = worker_actor_class().options(
            name=f"{self.cluster.name}-{name}", namespace=self.cluster.namespace,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=group, placement_group_bundle_index=0),
        ).remote(name, role, engine, self.server, self.worker_args, self.serve_argv,
                 self.cluster.registry_name, self.cluster.namespace,
                 self.cluster.threads_per_worker, peers, self.log_dir)
        worker = self.workers[name] = Worker(name, role, actor, group, time.monotonic(),
                                             peers=frozenset(peers))
        log.info("placing worker %s (%s, %d rank%s, %d x %s)", name, role, ranks,
                 "" if ranks == 1 else "s", stages, bundle)
        return worker

    def _num_ranks(self, role: str) -> int:
        parallel = self._engine_for(role).parallel
        return parallel.tensor_parallel_size * parallel.pipeline_parallel_size

    def _engine_for(self, role: str) -> EngineConfig:
        tp = self.cluster.role_tensor_parallel.get(role)
        if tp is None:
            return self.engine
        return replace(self.engine, parallel=replace(self.engine.parallel,
                                                     tensor_parallel_size=tp))

    def _drain(self, worker: Worker) -> None:
        import ray

        if worker.state != "running":  # not serving yet: nothing to finish
            log.info("scale-down: worker %s was still %s; stopping it", worker.name, worker.state)
            self._remove(worker)
            return
        worker.state, worker.drain_since = "draining", time.monotonic()
        worker.drain_version = ray.get(self.registry.set_draining.remote(worker.name))
        log.info("scale-down: draining worker %s", worker.name)

    def _progress_drains(self, router_view) -> None:
        import ray

        draining = [w for w in self.workers.values() if w.state == "draining"]
        if not draining:
            return
        acked, in_flight, _ = router_view
        for worker in draining:
            url = worker.record["url"]
            waited = time.monotonic() - worker.drain_since
            done = acked >= worker.drain_version and in_flight.get(url, 0) == 0
            if done or waited > self.cluster.drain_timeout_seconds:
                if not done:
                    log.warning("worker %s still has %d requests after %.0fs of draining; "
                                "stopping it", worker.name, in_flight.get(url, 0), waited)
                ray.get(self.registry.deregister.remote(worker.name))
                worker.state = "stopping"
                worker.stop_ref = worker.actor.stop.remote()

    def _sync_peers(self) -> None:
        """Every `PEER_SYNC_SECONDS`: if the alive nodes changed, rewrite each live worker's
        KV peers file (fire and forget: a worker that is gone is collected elsewhere)."""
        now = time.monotonic()
        if now < self._next_peer_sync:
            return
        self._next_peer_sync = now + PEER_SYNC_SECONDS
        nodes = _cluster_peers()
        if nodes == self._nodes:
            return
        if self._nodes:
            log.info("KV peers: cluster nodes now %s", ", ".join(nodes))
        self._nodes = nodes
        for worker in self.workers.values():
            if worker.state in ("placing", "starting", "running", "draining"):
                worker.actor.set_peers.remote(list(nodes))
                worker.peers = frozenset(nodes)

    def _failed(self, worker: Worker, why: str) -> None:
        now = time.monotonic()
        log.error("worker %s (%s) failed: %s", worker.name, worker.role, why)
        self._remove(worker)
        self.failures.append(now)
        while self.failures and now - self.failures[0] > self.cluster.failure_window_seconds:
            self.failures.popleft()
        if len(self.failures) > self.cluster.max_failures:
            self.gave_up = (f"{len(self.failures)} worker failures within "
                            f"{self.cluster.failure_window_seconds:.0f}s; last: {worker.name}: {why}")
            log.error("giving up: %s", self.gave_up)
        elif self.cluster.replace_dead_workers:
            self.num_replaced += 1  # the next reconcile starts a replacement (targets)
        else:
            import ray  # one actor call: a concurrent `hearth scale` is not undone

            ray.get(self.registry.decrement_target.remote(worker.role))

    def _remove(self, worker: Worker) -> None:
        """Out of the registry; actor and placement group gone."""
        import ray
        from ray.util.placement_group import remove_placement_group

        self.workers.pop(worker.name, None)
        for step in (lambda: ray.get(self.registry.deregister.remote(worker.name)),
                     lambda: ray.kill(worker.actor), lambda: remove_placement_group(worker.group)):
            try:
                step()
            except Exception:  # noqa: BLE001 - already gone with its node
                pass


def _reason(exc: BaseException) -> str:
    cause = getattr(exc, "cause", None)  # a RayTaskError: the exception the actor raised
    if cause is not None:
        return str(cause)[-3000:]
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[-1] if text else ''}"[:300]


def _cluster_peers() -> tuple[str, ...]:
    """Every alive node's address: the KV servers a decode worker may pull from."""
    import ray

    return tuple(sorted({n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")}))

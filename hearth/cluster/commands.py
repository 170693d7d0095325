"""`hearth up --cluster` and `hearth scale`: plain functions over configs (flags in hearth/flags/).

`up_cluster` connects to a running Ray cluster, starts the deployment's registry and controller
(hearth/cluster/controller.py), waits until the first workers serve, then runs the router in
this process, fed by discovery from the registry. On exit (SIGINT/SIGTERM, or the controller
giving up) every worker, placement group and the registry are removed; Ray's own ownership
ends them too if this process is killed outright (the registry and the workers' actors are
owned by this driver, non-detached, and each `hearth serve` dies with its actor).

`scale` connects to the same cluster, finds the deployment's registry by name and sets its
targets; with `wait`, it returns once the controller reports them reached.

`start` and `serve_router` are the two halves of `up_cluster` that the Python API shares
(hearth/cluster/deployment.py: the same controller, the router in a thread; reached as
`hearth.deploy(...)`). Nothing here imports Ray until a function runs, nor hearth/flags/ ever:
the caller hands down `serve_argv` (configs -> a worker's `hearth serve` flags).
"""

from __future__ import annotations

import logging
import secrets
import signal
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from hearth.cluster.cluster_config import ClusterConfig
from hearth.config import EngineConfig
from hearth.router.router_config import RouterConfig, UpConfig
from hearth.server.server_config import ServerConfig

if TYPE_CHECKING:
    from hearth.cluster.controller import Controller
    from hearth.cluster.worker_actor import ServeArgv

log = logging.getLogger("hearth.cluster")


def connect(cluster: ClusterConfig) -> None:
    """Join the cluster as a driver (an existing one: this never starts a local cluster)."""
    import ray

    if ray.is_initialized():
        return
    address = cluster.address
    ray.init(address=address, namespace=cluster.namespace, log_to_driver=False,
             logging_level=logging.WARNING, configure_logging=False)


def start(cluster: ClusterConfig, stack: UpConfig, engine: EngineConfig, server: ServerConfig,
          serve_argv: ServeArgv) -> tuple[Controller, str]:
    """Connect, start the registry and the first workers and wait until they serve: the
    controller and the workers' API key (what the router sends them). What `up_cluster` and
    `deploy()` share; on any failure nothing of the deployment is left on the cluster."""
    from hearth.cluster.controller import Controller

    targets = cluster.autoscale.clamp({"prefill": stack.num_prefill, "decode": stack.num_decode,
                                       "both": stack.num_workers})
    api_key = stack.worker_api_key or secrets.token_hex(16)
    kv_secret = engine.kv_transfer.secret or secrets.token_hex(16)
    engine = replace(engine, kv_transfer=replace(engine.kv_transfer, secret=""))
    connect(cluster)
    controller = Controller(cluster, engine, server, stack.worker_args, targets, serve_argv,
                            stack.log_dir)
    try:
        controller.start({"worker_api_key": api_key, "kv_secret": kv_secret})
        controller.wait_ready(stack.startup_timeout_seconds)
    except BaseException:
        controller.stop()
        raise
    return controller, api_key


def serve_router(controller: Controller, router: RouterConfig, worker_api_key: str) -> int:
    """The router, fed by discovery from the controller's registry, until it is stopped (0) or
    the controller gives up (1): route(), as `hearth route` and `hearth up` run it."""
    from hearth.cluster.worker_registry import RayRegistry
    from hearth.router.router_launch import route

    return route(replace(router, worker_api_key=worker_api_key), controller,
                 registry=RayRegistry(controller.registry))


def up_cluster(cluster: ClusterConfig, stack: UpConfig, engine: EngineConfig,
               server: ServerConfig, router: RouterConfig, serve_argv: ServeArgv) -> int:
    """0 on SIGINT/SIGTERM after serving, 1 if startup fails or the controller gives up."""
    try:
        import ray
    except ImportError:
        log.error("hearth up --cluster needs Ray: pip install 'hearth[ray]'")
        return 1
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)  # uvicorn installs its own later
    controller = None
    try:
        controller, api_key = start(cluster, stack, engine, server, serve_argv)
        signal.signal(signal.SIGTERM, previous)
        return serve_router(controller, router, api_key)
    except (RuntimeError, ValueError, ConnectionError) as exc:
        log.error("hearth up --cluster: %s", exc)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        if controller is not None:
            controller.stop()
        if ray.is_initialized():
            ray.shutdown()


def scale(cluster: ClusterConfig, targets: dict[str, int], wait: bool,
          timeout: float = 600.0) -> dict:
    """Set the deployment's targets (only the roles given); the registry's status after."""
    import ray

    connect(cluster)
    try:
        registry = ray.get_actor(cluster.registry_name, namespace=cluster.namespace)
    except ValueError:
        raise ValueError(f"no deployment named {cluster.name!r} on this cluster (hearth up "
                         "--cluster starts one)") from None
    return set_targets(registry, targets, wait, timeout)


def set_targets(registry, targets: dict[str, int], wait: bool, timeout: float) -> dict:
    """Set targets on a registry actor; with `wait`, return once the deployment serves them."""
    import ray

    try:
        ray.get(registry.set_targets.remote(targets))
    except ray.exceptions.RayTaskError as exc:
        raise ValueError(str(exc.cause) if exc.cause else str(exc)) from None
    deadline = time.monotonic() + timeout
    while True:
        status = ray.get(registry.status.remote())
        if not wait or _reached(status):
            return status
        if time.monotonic() > deadline:
            raise TimeoutError(f"targets not reached after {timeout:.0f}s: {status}")
        time.sleep(0.5)


def _reached(status: dict) -> bool:
    """Every role has exactly its target of serving workers, nothing is draining/starting, and
    the router routes to every one of them (it learns of a new worker on its next discovery
    round and routes to it after its first health check: a worker that runs is not yet one
    that a request reaches)."""
    workers = status.get("workers", [])
    for role, target in status["targets"].items():
        serving = sum(w["role"] == role and w["state"] == "running" for w in workers)
        if serving != target:
            return False
    return all(w["state"] == "running" for w in workers) and router_routes_all(status)


def router_routes_all(status: dict) -> bool:
    """The router applied the registry's current worker list and routes to every running
    worker in it (a registry status, as `hearth scale` prints it)."""
    router = status.get("router", {})
    names = set(router.get("routes_to", ()))
    return router.get("applied", -1) >= status.get("version", 0) and all(
        w["name"] in names for w in status.get("workers", []) if w["state"] == "running")


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt

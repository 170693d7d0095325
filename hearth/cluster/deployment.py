"""The Python API of a cluster deployment: `hearth.deploy(...)` -> `Deployment`.

The same deployment as `hearth up --cluster` (hearth/cluster/commands.py's `start` and
`serve_router`: one controller, the router fed by discovery), run inside the caller's process:
the router serves from a background thread and the call returns once it answers. Ray is
imported only when `deploy` runs; if this call connected to Ray it also disconnects on
`shutdown()` (a caller that had connected keeps its connection). `hearth.deploy` (the package's
Python API, beside `hearth.LLM`) calls `deploy` here with hearth/flags/'s `serve_argv`, which
this package may not import (it sits below the flags).

    with hearth.deploy(model="smollm2-135m-instruct", decode=2) as d:
        openai.OpenAI(base_url=d.url + "/v1", api_key="none").chat.completions.create(...)
        d.scale(decode=3)
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import replace

from hearth.cluster.cluster_config import AutoscaleConfig, ClusterConfig
from hearth.cluster.worker_actor import ServeArgv
from hearth.config import EngineConfig
from hearth.router.router_config import RouterConfig, UpConfig
from hearth.server.server_config import ServerConfig

log = logging.getLogger("hearth.cluster")


class Deployment:
    """A running cluster deployment whose router serves at `url` from this process."""

    def __init__(self, controller, router: RouterConfig, worker_api_key: str,
                 owns_ray: bool) -> None:
        self.controller, self.router = controller, router
        self.url = f"http://{router.host}:{router.port}"
        self.exit_code: int | None = None  # route()'s, once the router stopped
        self._owns_ray = owns_ray
        self._closed = False
        self._thread = threading.Thread(target=self._serve, args=(worker_api_key,),
                                        name="hearth-router", daemon=True)

    def _serve(self, worker_api_key: str) -> None:
        from hearth.cluster.commands import serve_router

        try:
            self.exit_code = serve_router(self.controller, self.router, worker_api_key)
        except Exception:  # noqa: BLE001 - the caller learns it from wait_serving / status
            log.exception("the router stopped")
            self.exit_code = 1

    def wait_serving(self, timeout: float) -> None:
        """Start the router; return once its /health answers 200 (RuntimeError otherwise)."""
        import httpx

        self._thread.start()
        deadline = time.monotonic() + timeout
        while True:
            if not self._thread.is_alive():
                raise RuntimeError(f"the router stopped (exit {self.exit_code}) before serving")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the router at {self.url} not healthy after {timeout:.0f}s")
            time.sleep(0.2)

    def status(self) -> dict:
        """What `hearth scale` prints: targets, each worker's state, node, host and KV peers."""
        import ray

        if self.controller.registry is None:
            raise RuntimeError("this deployment was shut down")
        return ray.get(self.controller.registry.status.remote())

    def scale(self, prefill: int | None = None, decode: int | None = None,
              workers: int | None = None, wait: bool = True, timeout: float = 600.0) -> dict:
        """Set the targets of the roles given (as `hearth scale`); with `wait`, return once the
        deployment serves exactly them. ValueError for targets the registry refuses."""
        from hearth.cluster.commands import set_targets

        if self.controller.registry is None:
            raise RuntimeError("this deployment was shut down")
        targets = {role: n for role, n in (("prefill", prefill), ("decode", decode),
                                           ("both", workers)) if n is not None}
        return set_targets(self.controller.registry, targets, wait, timeout)

    def shutdown(self) -> None:
        """Stop the router, every worker (their placement groups) and the registry. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.controller.stop_router()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        self.controller.stop()
        if self._owns_ray:
            import ray

            ray.shutdown()

    def __enter__(self) -> Deployment:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def deploy(model: str | None = None, *, prefill: int = 1, decode: int = 1, workers: int = 0,
           address: str | None = None, name: str | None = None, host: str = "127.0.0.1",
           port: int | None = None, api_key: str | None = None,
           worker_args: tuple[str, ...] | list[str] = (),
           autoscale: dict[str, tuple[int, int]] | None = None,
           autoscale_target_requests: float | None = None,
           autoscale_upscale_delay: float | None = None,
           autoscale_downscale_delay: float | None = None,
           engine: EngineConfig | None = None, server: ServerConfig | None = None,
           router: RouterConfig | None = None, cluster: ClusterConfig | None = None,
           stack: UpConfig | None = None, serve_argv: ServeArgv) -> Deployment:
    """Start a deployment on a running Ray cluster and serve its router from this process.

    The arguments are `hearth up --cluster`'s: `model` (else `engine`'s), the workers per role,
    the cluster `address` ("auto": $RAY_ADDRESS, else the local head) and deployment `name`
    (else `cluster`'s), where the router listens (`port` None: a free one) and its client
    `api_key`, `worker_args` (extra `hearth serve` flags), and the autoscaler: `autoscale`
    maps a role ("prefill", "decode", "both") to its (MIN, MAX) workers. `engine`, `server`,
    `router`, `cluster` and `stack` are the full configs, for anything else; the plain
    arguments override them. Raises RuntimeError (with nothing left on the cluster) if the
    workers or the router do not come up within the startup timeout. `serve_argv` turns a
    worker's configs into its `hearth serve` flags (`hearth.deploy` passes hearth/flags/'s).
    """
    from hearth.cluster.commands import start

    engine = engine or EngineConfig()
    if model is not None:
        engine = replace(engine, model=replace(engine.model, model=model))
    cluster = cluster or ClusterConfig()
    cluster = replace(cluster, address=address or cluster.address, name=name or cluster.name,
                      autoscale=_autoscale_config(cluster.autoscale, autoscale,
                                                  autoscale_target_requests,
                                                  autoscale_upscale_delay,
                                                  autoscale_downscale_delay))
    stack = stack or UpConfig()
    stack = replace(stack, num_prefill=prefill, num_decode=decode, num_workers=workers,
                    worker_args=tuple(worker_args) or stack.worker_args)
    router = router or RouterConfig()
    router = replace(router, host=host, port=port or _free_port(host),
                     api_key=api_key if api_key is not None else router.api_key,
                     tokenizer_model=router.tokenizer_model or engine.model.model)
    import ray

    owns_ray = not ray.is_initialized()
    try:
        controller, worker_api_key = start(cluster, stack, engine, server or ServerConfig(),
                                           serve_argv)
    except BaseException:
        if owns_ray and ray.is_initialized():
            ray.shutdown()
        raise
    deployment = Deployment(controller, router, worker_api_key, owns_ray)
    try:
        deployment.wait_serving(stack.startup_timeout_seconds)
    except BaseException:
        deployment.shutdown()
        raise
    return deployment


def _autoscale_config(base: AutoscaleConfig, ranges, target_requests, upscale_delay,
                      downscale_delay) -> AutoscaleConfig:
    given = {"ranges": dict(ranges) if ranges is not None else None,
             "target_requests": target_requests, "upscale_delay_seconds": upscale_delay,
             "downscale_delay_seconds": downscale_delay}
    return replace(base, **{k: v for k, v in given.items() if v is not None})


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]

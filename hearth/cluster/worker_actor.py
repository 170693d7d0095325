"""`WorkerProcess`: the Ray actor that runs one hearth worker (`hearth serve` in a role) on its node.

The controller creates one per worker, inside the worker's own placement group, and drives it:

  * `start()` fetches the secrets from the registry (a method call: never a command line, never
    a runtime_env Ray would show), picks a free port on its node's address, starts `hearth
    serve` there (KV transfer server bound on the same address; its KV peers, the cluster's
    nodes, in a `--kv-peers-file` that `set_peers` rewrites as nodes come and go),
    waits until `/health` answers, registers the worker and returns its record;
  * `wait()` returns the process's exit status when it ends (the controller keeps one call of it
    outstanding per worker: it returns on a crash, and raises RayActorError when the actor, or
    its whole node, is gone);
  * `stop()` ends the process (SIGTERM: the server stops taking requests; SIGKILL after a grace);
  * the process gets PR_SET_PDEATHSIG(SIGKILL): if the actor dies (its node lost, `ray stop`,
    the controller killing it) the worker dies with it instead of serving on as an orphan
    nobody routes to.
The actor reserves no CPU itself (num_cpus=0); its placement group holds the worker's resources.

The `hearth serve` flags of a worker's configs come from `serve_argv`, which the caller hands
down (hearth/flags/'s, by way of hearth/cli.py or `hearth.deploy`): the flag names live in
hearth/flags/ alone, and this package never imports it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from dataclasses import replace
from pathlib import Path
from typing import Callable

from hearth.config import EngineConfig, Role
from hearth.api.readiness import NotReadyError, wait_ready
from hearth.cluster.cluster_config import REGISTRY_SUFFIX
from hearth.server.server_config import ServerConfig

log = logging.getLogger("hearth.cluster")

PR_SET_PDEATHSIG = 1

# The `hearth serve` flags that rebuild these configs (hearth/flags/'s serve_argv). Ray sends it
# to the actor by reference: the function's module is imported on the worker's node.
ServeArgv = Callable[[EngineConfig, ServerConfig], list[str]]


def free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class WorkerProcess:
    def __init__(self, name: str, role: str, engine: EngineConfig, server: ServerConfig,
                 worker_args: tuple[str, ...], serve_argv: ServeArgv, registry_name: str,
                 namespace: str, threads: int, peers: tuple[str, ...],
                 log_dir: str | None = None) -> None:
        self.name, self.role = name, role
        self.engine, self.server, self.worker_args = engine, server, worker_args
        self.serve_argv = serve_argv
        self.registry_name, self.namespace = registry_name, namespace
        self.threads, self.peers = threads, tuple(peers)
        self.log_dir = log_dir
        # Files are named by deployment and worker: two deployments on one cluster (`hearth up`
        # and a `hearth.deploy`) both have a `both-0`, and shared a log file before.
        self.file_stem = f"{registry_name.removesuffix(REGISTRY_SUFFIX)}-{name}"
        self.log_path: Path | None = None
        self.peers_path: Path | None = None  # the worker's --kv-peers-file (set_peers rewrites)
        self.stages: list = []  # StageProcesses actors of pipeline stages 1.. (P > 1)
        self.local_ranks: list[subprocess.Popen] = []  # stage 0's ranks 1..T-1 (P > 1)
        self.stage_nodes: list[str] = []  # the Ray node of each stage (P > 1)
        self.rank_pids: dict[int, int] = {}  # rank -> process id on its node (P > 1)
        self.process: subprocess.Popen | None = None
        self.url: str | None = None
        self._lock = threading.Lock()
        self._stopping = False
        self._prctl = ctypes.CDLL(None, use_errno=True).prctl

    def _command(self, host: str, port: int) -> list[str]:
        kv = replace(self.engine.kv_transfer, role=Role.parse(self.role), secret="", host=host,
                     peers=(), peers_file=str(self.peers_path))
        engine = replace(self.engine, kv_transfer=kv)
        server = replace(self.server, host=host, port=port, api_key=None)
        return [sys.executable, "-m", "hearth.cli", "serve", *self.serve_argv(engine, server),
                *self.worker_args]

    def _environment(self, secrets: dict[str, str]) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "HEARTH_WORKER_API_KEY",
                            "HEARTH_KV_SECRET", "HEARTH_API_KEY")}
        # Ray sets OMP_NUM_THREADS to the actor's logical CPUs (0 here): a worker computes with
        # torch's own default, or the threads the deployment asks for.
        if self.threads:
            env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(self.threads)
        env["PYTHONUNBUFFERED"] = "1"
        env["HEARTH_API_KEY"] = secrets["worker_api_key"]
        if self.role != "both":
            env["HEARTH_KV_SECRET"] = secrets["kv_secret"]
        return env

    def start(self, timeout: float) -> dict:
        import ray

        registry = ray.get_actor(self.registry_name, namespace=self.namespace)
        secrets = ray.get(registry.secrets.remote())
        host = ray.util.get_node_ip_address()
        node = ray.get_runtime_context().get_node_id()
        port = free_port(host)
        self.log_path = _log_dir(self.log_dir) / f"{self.file_stem}.log"
        env = self._environment(secrets)
        with self._lock:
            if self._stopping:
                raise RuntimeError(f"worker {self.name} was stopped before it started")
            self.peers_path = self.log_path.with_suffix(".peers")
            self._write_peers()
            command = self._command(host, port)
            if self._num_stages > 1:
                env = self._start_rank_set(command, env, host)
            self.process = _spawn(command, env, self.log_path, self._prctl)
        self.url = f"http://{host}:{port}"
        try:
            wait_ready(self.url, self.process, timeout)
        except NotReadyError as exc:
            self.stop()
            tail = self.log_path.read_text(errors="replace")[-2500:]
            raise RuntimeError(f"worker {self.name} ({self.role}) on node {node[:12]}: {exc}; "
                               f"the end of {self.log_path}:\n{tail}") from None
        ray.get(registry.register.remote(self.name, self.role, self.url, node))
        return {"name": self.name, "role": self.role, "url": self.url, "node": node,
                "pid": self.process.pid, "log": str(self.log_path),
                "peers_file": str(self.peers_path), "stage_nodes": self.stage_nodes,
                "rank_pids": {**self.rank_pids, 0: self.process.pid} if self.rank_pids else {}}

    @property
    def _num_stages(self) -> int:
        return self.engine.parallel.pipeline_parallel_size

    def _start_rank_set(self, command: list[str], env: dict[str, str], host: str) -> dict:
        """T x P ranks over the worker's placement group, one bundle per pipeline stage: this
        node runs stage 0 (rank 0 is the `hearth serve` driver, started by the caller with the
        returned environment), a `StageProcesses` actor in bundle s runs stage s's T ranks. They
        meet as a torchrun rank set would (RANK, WORLD_SIZE, MASTER_ADDR/PORT: the driver hosts
        the rendezvous store on this node). Under `_lock`."""
        import ray
        from ray.util import get_current_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        tp = self.engine.parallel.tensor_parallel_size
        world = tp * self._num_stages
        rendezvous = {"WORLD_SIZE": str(world), "MASTER_ADDR": host,
                      "MASTER_PORT": str(free_port(host))}
        rank_env = {k: v for k, v in env.items() if k not in SECRET_VARIABLES}
        group = get_current_placement_group()
        self.stage_nodes = [ray.get_runtime_context().get_node_id()]
        for stage in range(1, self._num_stages):
            context = ray.get_runtime_context()
            actor = stage_actor_class().options(
                name=f"{context.get_actor_name()}-stage{stage}", namespace=self.namespace,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=group, placement_group_bundle_index=stage)).remote()
            self.stages.append(actor)
            ranks = list(range(stage * tp, (stage + 1) * tp))
            node, pids = ray.get(actor.start.remote(
                command, {**rank_env, **rendezvous}, ranks, f"{self.file_stem}-stage{stage}",
                self.log_dir))
            self.stage_nodes.append(node)
            self.rank_pids.update(pids)
        for rank in range(1, tp):  # stage 0's other tensor-parallel ranks, on this node
            log_path = self.log_path.with_name(f"{self.file_stem}-rank{rank}.log")
            self.local_ranks.append(_spawn(command, {**rank_env, **rendezvous, "RANK": str(rank),
                                                     "LOCAL_RANK": str(rank)},
                                           log_path, self._prctl))
            self.rank_pids[rank] = self.local_ranks[-1].pid
        return {**env, **rendezvous, "RANK": "0", "LOCAL_RANK": "0"}

    def set_peers(self, peers: list[str]) -> None:
        """The cluster's node addresses now: the worker (a decode worker re-reads its peers
        file when it changes) may pull KV from prefill workers on any of them."""
        with self._lock:
            self.peers = tuple(peers)
            if self.peers_path is not None:
                self._write_peers()

    def _write_peers(self) -> None:
        """Atomically (a reader never sees half a file); under `_lock`."""
        tmp = self.peers_path.with_suffix(".peers.tmp")
        tmp.write_text("# KV peers of this hearth worker, kept by hearth up --cluster\n"
                       + "".join(f"{p}\n" for p in self.peers))
        os.replace(tmp, self.peers_path)

    def wait(self) -> int:
        """The worker process's exit status, once it ends."""
        while self.process is None:  # start() has not forked yet
            threading.Event().wait(0.05)
        return self.process.wait()

    def stop(self, grace: float = 20.0) -> int | None:
        with self._lock:
            self._stopping = True
            process = self.process
        code = _end(process, grace) if process is not None else None
        for rank in self.local_ranks:  # the driver's end ends them too; these are the stragglers
            _end(rank, 5.0)
        if self.stages:
            import ray

            try:
                ray.get([stage.stop.remote() for stage in self.stages], timeout=30)
            except Exception:  # noqa: BLE001 - a stage's node is gone: its ranks died with it
                pass
            for stage in self.stages:
                ray.kill(stage)
        return code

    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None


def _log_dir(configured: str | None) -> Path:
    """Where a worker's output goes: `hearth up --log-dir` (on each node), else the Ray
    session's log folder on the worker's node (beside Ray's own logs)."""
    if configured:
        path = Path(configured)
    else:
        try:
            from ray._private.worker import global_worker

            path = Path(global_worker.node.get_logs_dir_path())
        except Exception:  # noqa: BLE001 - a Ray without that private path
            path = Path(tempfile.gettempdir())
    path.mkdir(parents=True, exist_ok=True)
    return path


def worker_actor_class():
    """WorkerProcess as a Ray actor class: threaded (wait, stop and start overlap), never
    restarted by Ray (the controller decides what replaces a dead worker)."""
    import ray

    return ray.remote(num_cpus=0, max_restarts=0, max_concurrency=4)(WorkerProcess)


SECRET_VARIABLES = ("HEARTH_API_KEY", "HEARTH_KV_SECRET")  # the driver's alone


def _spawn(command: list[str], env: dict[str, str], log_path: Path, prctl) -> subprocess.Popen:
    """A child that dies with this actor (PR_SET_PDEATHSIG), output appended to `log_path`."""
    def preexec() -> None:  # in the child before exec
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)

    with open(log_path, "a") as log_file:
        return subprocess.Popen(command, env=env, stdout=log_file, stderr=subprocess.STDOUT,
                                preexec_fn=preexec, start_new_session=True)


def _end(process: subprocess.Popen, grace: float) -> int:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            process.kill()
    return process.wait()


class StageProcesses:
    """The ranks of one pipeline stage (1 and up) of a worker, on its bundle's node; created and
    owned by the worker's `WorkerProcess` (so they die with it, and it with its node)."""

    def __init__(self) -> None:
        self.processes: list[subprocess.Popen] = []
        self._prctl = ctypes.CDLL(None, use_errno=True).prctl

    def start(self, command: list[str], env: dict[str, str], ranks: list[int], name: str,
              log_dir: str | None) -> tuple[str, dict[int, int]]:
        """Start the ranks (same `hearth serve` argv as the driver: under RANK > 0 it serves
        the driver's steps instead); returns this node's id and each rank's process id."""
        import ray

        folder = _log_dir(log_dir)
        for local, rank in enumerate(ranks):
            self.processes.append(_spawn(command, {**env, "RANK": str(rank),
                                                   "LOCAL_RANK": str(local)},
                                         folder / f"{name}-rank{rank}.log", self._prctl))
        return (ray.get_runtime_context().get_node_id(),
                {rank: process.pid for rank, process in zip(ranks, self.processes)})

    def stop(self) -> None:
        for process in self.processes:
            _end(process, 5.0)


def stage_actor_class():
    import ray

    return ray.remote(num_cpus=0, max_restarts=0)(StageProcesses)


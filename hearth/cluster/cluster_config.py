"""What a cluster deployment asks of Ray (hearth/cluster/). Frozen, built once from flags."""

from __future__ import annotations

from dataclasses import dataclass, field

REGISTRY_SUFFIX = "-registry"


@dataclass(frozen=True)
class ClusterConfig:
    address: str = "auto"  # "auto": $RAY_ADDRESS, else the local head (as ray.init does)
    name: str = "hearth"  # the deployment; its registry actor is "<name>-registry"
    namespace: str = "hearth"  # Ray namespace of the registry (so `hearth scale` finds it)
    # What each rank of a worker asks of Ray. The logical CPUs are a reservation for placement,
    # not the worker's compute threads (those are torch's own, or `threads_per_worker`).
    cpus_per_rank: float = 1.0
    gpus_per_rank: float = 0.0
    memory_per_rank_bytes: int = 0  # 0: no memory reservation
    threads_per_worker: int = 0  # OMP/torch threads of a worker's ranks; 0: torch's default
    # Per-role tensor parallelism (None: the engine's -tp). PD roles need T = 1 (the KV transfer
    # reads one process's cache), so this is mostly for monolithic workers (`--workers`).
    role_tensor_parallel: dict[str, int] = field(default_factory=dict, hash=False)
    replace_dead_workers: bool = True  # a worker (or node) that dies is started again elsewhere
    max_failures: int = 5  # worker deaths or failed starts within failure_window_seconds ...
    failure_window_seconds: float = 300.0  # ... after which the deployment stops (exit 1)
    drain_timeout_seconds: float = 600.0  # a draining worker is stopped after this regardless
    start_timeout_seconds: float = 300.0  # one worker: placed, loaded, healthy within this
    interval_seconds: float = 0.25  # the controller's reconcile period

    @property
    def registry_name(self) -> str:
        return self.name + REGISTRY_SUFFIX

    def __post_init__(self) -> None:
        if self.cpus_per_rank < 0 or self.gpus_per_rank < 0 or self.memory_per_rank_bytes < 0:
            raise ValueError("cluster resources per rank must be >= 0")
        for role, tp in self.role_tensor_parallel.items():
            if role not in ("prefill", "decode", "both") or tp < 1:
                raise ValueError(f"tensor parallel size for {role!r}: {tp} (roles: prefill, "
                                 "decode, both; sizes >= 1)")

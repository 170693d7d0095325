"""What a cluster deployment asks of Ray (hearth/cluster/). Frozen, built once from flags (or by
`hearth.deploy`'s arguments)."""

from __future__ import annotations

from dataclasses import dataclass, field

REGISTRY_SUFFIX = "-registry"
STAGE_STRATEGIES = ("PACK", "SPREAD", "STRICT_SPREAD")
ROLES = ("prefill", "decode", "both")


@dataclass(frozen=True)
class AutoscaleConfig:
    """The optional autoscaler (hearth/cluster/autoscaler.py): per role, a worker count between
    MIN and MAX that follows the requests the router has open on that role's workers."""

    ranges: dict[str, tuple[int, int]] = field(default_factory=dict, hash=False)  # role: (min, max)
    # In-flight requests per worker the autoscaler aims at (Ray Serve's target_ongoing_requests):
    # a role wants ceil(open requests / target) workers, within its range.
    target_requests: float = 2.0
    upscale_delay_seconds: float = 30.0  # the wish for more workers must hold this long ...
    downscale_delay_seconds: float = 600.0  # ... and for fewer this long (no flapping)

    def __post_init__(self) -> None:
        for role, (low, high) in self.ranges.items():
            if role not in ROLES:
                raise ValueError(f"autoscale: unknown role {role!r} (roles: {', '.join(ROLES)})")
            if not 0 <= low <= high or (role != "prefill" and high < 1):
                raise ValueError(f"autoscale {role}: {low}:{high} (need 0 <= MIN <= MAX, "
                                 "and MAX >= 1 for decode and monolithic workers)")
        if self.target_requests <= 0:
            raise ValueError("autoscale target requests per worker must be > 0")
        if self.upscale_delay_seconds < 0 or self.downscale_delay_seconds < 0:
            raise ValueError("autoscale delays must be >= 0")

    def clamp(self, targets: dict[str, int]) -> dict[str, int]:
        """`targets` with each autoscaled role's count moved into its range."""
        return {role: min(max(n, self.ranges[role][0]), self.ranges[role][1])
                if role in self.ranges else n for role, n in targets.items()}


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
    # A worker of P > 1 pipeline stages gets one bundle per stage (T ranks each, packed on one
    # node); this Ray strategy places the bundles: PACK (one node if it has room, else several),
    # SPREAD (several nodes if they have room), STRICT_SPREAD (each stage on its own node).
    stage_strategy: str = "PACK"
    replace_dead_workers: bool = True  # a worker (or node) that dies is started again elsewhere
    max_failures: int = 5  # worker deaths or failed starts within failure_window_seconds ...
    failure_window_seconds: float = 300.0  # ... after which the deployment stops (exit 1)
    drain_timeout_seconds: float = 600.0  # a draining worker is stopped after this regardless
    start_timeout_seconds: float = 300.0  # one worker: placed, loaded, healthy within this
    interval_seconds: float = 0.25  # the controller's reconcile period
    autoscale: AutoscaleConfig = field(default_factory=AutoscaleConfig)

    @property
    def registry_name(self) -> str:
        return self.name + REGISTRY_SUFFIX

    def __post_init__(self) -> None:
        if self.cpus_per_rank < 0 or self.gpus_per_rank < 0 or self.memory_per_rank_bytes < 0:
            raise ValueError("cluster resources per rank must be >= 0")
        if self.stage_strategy not in STAGE_STRATEGIES:
            raise ValueError(f"stage placement {self.stage_strategy!r}: one of "
                             f"{', '.join(s.lower().replace('_', '-') for s in STAGE_STRATEGIES)}")
        for role, tp in self.role_tensor_parallel.items():
            if role not in ROLES or tp < 1:
                raise ValueError(f"tensor parallel size for {role!r}: {tp} (roles: prefill, "
                                 "decode, both; sizes >= 1)")

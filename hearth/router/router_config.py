"""The router's configuration and `hearth up`'s: frozen, built once from flags in hearth/flags/."""

from __future__ import annotations

from dataclasses import dataclass, field

from hearth.api.edge import DoorwayConfig
from hearth.router.hops import HopTimeouts
from hearth.router.policy import PolicyConfig


@dataclass(frozen=True)
class HealthConfig:
    interval_seconds: float = 1.0  # active checks: GET /load on every endpoint this often
    # A /load answer slower than this is a stale load report, not a dead worker: the endpoint
    # stays in, and its polls back off (doubling, up to max_interval_seconds) until one is fast.
    timeout_seconds: float = 10.0
    max_interval_seconds: float = 30.0
    eject_seconds: float = 2.0  # a failed endpoint is not re-admitted for at least this long
    max_retries: int = 2  # extra endpoints tried for one hop before giving up
    discovery_interval_seconds: float = 0.25  # (cluster) how often the worker registry is read


@dataclass(frozen=True)
class SupervisorConfig:
    """How `hearth up` restarts a worker that exited (hearth/router/up.py)."""

    max_restarts: int = 5  # restarts of one worker within window_seconds; one more death: give up
    window_seconds: float = 300.0
    backoff_seconds: float = 1.0  # delay before a restart, doubled per restart still in the window
    max_backoff_seconds: float = 30.0


@dataclass(frozen=True)
class UpConfig:
    """The stack `hearth up` starts: how many workers of each role, and how (hearth/router/up.py).

    What each worker serves is an EngineConfig and a ServerConfig (hearth up's own engine flags);
    this is only what is particular to running several of them on one machine."""

    num_prefill: int = 1  # prefill-role workers
    num_decode: int = 1  # decode-role workers
    num_workers: int = 0  # monolithic (role both) workers
    pin: bool = False  # each worker on its own CPU cores (sched_setaffinity + OMP_NUM_THREADS)
    worker_args: tuple[str, ...] = ()  # extra `hearth serve` flags for every worker, verbatim
    worker_api_key: str | None = None  # what the router sends workers; None: a random one
    startup_timeout_seconds: float = 300.0  # every worker healthy within this, or exit 1
    log_dir: str | None = None  # one log file per worker here; None: this process's terminal
    supervisor: SupervisorConfig = field(default_factory=SupervisorConfig)


@dataclass(frozen=True)
class RouterConfig:
    prefill: tuple[str, ...] = ()  # prefill-role worker URLs
    decode: tuple[str, ...] = ()  # decode-role worker URLs
    workers: tuple[str, ...] = ()  # monolithic (role both) worker URLs
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # clients must send "Authorization: Bearer KEY"
    worker_api_key: str | None = None  # what the router sends to workers
    # names `model` may give, the first is the one responses carry; (): the workers' names
    served_model_names: tuple[str, ...] = ()
    tokenizer_model: str | None = None  # tokenize in the router (else ask a worker's /tokenize)
    max_body_bytes: int = 32 * 2**20  # larger request bodies: 413
    cpu_threads: int = 2  # rendering/tokenizing off the event loop (hearth.api.edge.CpuPool)
    show_worker_urls: bool = False  # /load names workers by URL even without an api_key
    session_capacity: int = 65536  # x-session-affinity keys remembered (LRU)
    log_level: str = "info"
    allowed_origins: tuple[str, ...] = ()  # CORS: browser origins allowed ("*": any); (): off
    access_log: bool = True  # one line per request on the hearth.access logger
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    timeouts: HopTimeouts = field(default_factory=HopTimeouts)
    # clients' header/body/keep-alive timeouts and connections per address (hearth/api/edge.py)
    doorway: DoorwayConfig = field(default_factory=DoorwayConfig)

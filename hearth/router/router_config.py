"""The router's configuration: frozen, built once from flags in hearth/router/launch.py."""

from __future__ import annotations

from dataclasses import dataclass, field

from hearth.router.hops import HopTimeouts
from hearth.router.policy import PolicyConfig


@dataclass(frozen=True)
class HealthConfig:
    interval_seconds: float = 1.0  # active checks: GET /load on every endpoint this often
    eject_seconds: float = 2.0  # a failed endpoint is not re-admitted for at least this long
    max_retries: int = 2  # extra endpoints tried for one hop before giving up


@dataclass(frozen=True)
class RouterConfig:
    prefill: tuple[str, ...] = ()  # prefill-role worker URLs
    decode: tuple[str, ...] = ()  # decode-role worker URLs
    workers: tuple[str, ...] = ()  # monolithic (role both) worker URLs
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # clients must send "Authorization: Bearer KEY"
    worker_api_key: str | None = None  # what the router sends to workers
    served_model_name: str | None = None  # None: the name the workers serve
    tokenizer_model: str | None = None  # tokenize in the router (else ask a worker's /tokenize)
    max_body_bytes: int = 32 * 2**20
    session_capacity: int = 65536  # x-session-affinity keys remembered (LRU)
    log_level: str = "info"
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    timeouts: HopTimeouts = field(default_factory=HopTimeouts)

"""`hearth route`'s and `hearth up`'s options (the router's, the stack's), and the
cluster's and `hearth scale`'s (declared by hand: their values are reshaped)."""

from __future__ import annotations

import argparse

from hearth.cluster.cluster_config import STAGE_STRATEGIES, AutoscaleConfig, ClusterConfig
from hearth.router.policy import POLICIES
from hearth.router.router_config import RouterConfig, SupervisorConfig, UpConfig
from hearth.server.server_config import ServerConfig
from hearth.flags.options import (Option, _add_groups, _add_options, _bytes_to_mb, _field_values,
                                  _kwargs, _mb_to_bytes, _names, _names_flag, _options,
                                  add_secret_args)
from hearth.flags.serve import _edge_options, doorway_config


# ---- hearth route and hearth up: the router's flags, and the stack's -------------------------


ROUTER_OPTIONS = (  # `hearth route`'s and `hearth up`'s, the "router" group
    Option("--host", "router.host"),
    Option("--port", "router.port", int),
    Option("--api-key", "router.api_key",
           help="clients must send 'Authorization: Bearer KEY' (visible in ps: prefer "
                "$HEARTH_API_KEY or --api-key-file)",
           file_help="read the API key from this file"),
    Option("--policy", "router.policy.name", choices=POLICIES,
           help="cost: token- and cache-aware (default); round_robin: the cache-blind baseline"),
    Option("--block-size", "router.policy.block_size", int,  # up: the engine's --block-size
           "the workers' KV block size (the router hashes prompts the same way)"),
    Option("--disagg-threshold", "router.policy.disagg_threshold", float,
           "skip the prefill hop when the decode endpoint holds at least this fraction of the "
           "prompt (1.0: only when it holds all of it)"),
    Option("--min-disagg-tokens", "router.policy.min_disagg_tokens", int,
           "shorter prompts are prefilled by the decode endpoint itself"),
    Option("--prefill-weight", "router.policy.prefill_weight", float),
    Option("--decode-weight", "router.policy.decode_weight", float),
    Option("--transfer-weight", "router.policy.transfer_weight", float),
    Option("--tier-weight", "router.policy.tier_weight", float,
           "cost per prompt token a worker loads from its KV tiers (docs/kv_tiers.md)"),
    Option("--affinity-max-cost-ratio", "router.policy.affinity_max_cost_ratio", float,
           "a session's endpoints are left when they cost more than this times the best"),
    Option("--health-interval", "router.health.interval_seconds", float,
           "seconds between /load polls of each endpoint"),
    Option("--health-timeout", "router.health.timeout_seconds", float,
           "a slower /load answer is a stale load report: the endpoint stays in and its polls "
           "back off (a refused connection or an error status takes it out)"),
    Option("--eject-seconds", "router.health.eject_seconds", float),
    Option("--max-retries", "router.health.max_retries", int),
    Option("--connect-timeout", "router.timeouts.connect", float),
    Option("--request-timeout", "router.timeouts.request", float),
    Option("--stream-idle-timeout", "router.timeouts.stream_idle", float),
    Option("--max-body-mb", "router.max_body_bytes", float, "larger request bodies get 413",
           to_config=_mb_to_bytes, to_flag=_bytes_to_mb),
    Option("--show-worker-urls", "router.show_worker_urls", bool,
           "list worker URLs on /load even without --api-key (with a key they are shown to key "
           "holders)"),
    Option("--log-level", "router.log_level"),
    *_edge_options("router"),
)
ROUTE_MODEL_OPTIONS = (  # `hearth route`'s; `hearth up` has the engine's flags of these names
    Option("--model", "router.tokenizer_model",
           help="tokenize in the router with this model's tokenizer (built-in name, .gguf or HF "
                "folder); without it the router asks a worker's /tokenize"),
    Option("--served-model-name", "router.served_model_names", nargs="+", metavar="NAME",
           to_config=_names, to_flag=_names_flag,
           help="the names clients may give as `model` (the first is the one responses carry; "
                "default: the model's own name)"),
)


def add_router_args(p: argparse.ArgumentParser, with_block_size: bool = True) -> None:
    """Flags shared by `route` and `up` (policy, health, timeouts, the router's own address)."""
    _add_options(p.add_argument_group("router"),
                 [o for o in ROUTER_OPTIONS if with_block_size or o.flag != "--block-size"])


def add_route_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("endpoints")
    g.add_argument("--prefill", nargs="+", action="extend", default=[], metavar="URL",
                   help="prefill-role workers (hearth serve --role prefill)")
    g.add_argument("--decode", nargs="+", action="extend", default=[], metavar="URL",
                   help="decode-role workers (hearth serve --role decode)")
    g.add_argument("--worker", nargs="+", action="extend", default=[], metavar="URL",
                   help="monolithic workers (hearth serve, role both)")
    add_secret_args(g, "--worker-api-key",
                    "the key the router sends to workers (prefer $HEARTH_WORKER_API_KEY)",
                    "read the workers' key from this file")
    _add_options(g, ROUTE_MODEL_OPTIONS)
    add_router_args(p)


def router_config(a: argparse.Namespace, prefill=(), decode=(), workers=(),
                  worker_api_key: str | None = None) -> RouterConfig:
    """The router `a` asks for, in front of these worker URLs (`hearth up` adds its own)."""
    values = _field_values(ROUTER_OPTIONS + ROUTE_MODEL_OPTIONS, a)
    return RouterConfig(prefill=tuple(prefill), decode=tuple(decode), workers=tuple(workers),
                        worker_api_key=worker_api_key,
                        **_kwargs(RouterConfig, values, "router."))


UP_OPTIONS = (("stack", (
    Option("--prefill", "up.num_prefill", int, "prefill workers (default: %(default)s)"),
    Option("--decode", "up.num_decode", int, "decode workers (default: %(default)s)"),
    Option("--workers", "up.num_workers", int, "monolithic workers (role both)"),
    Option("--pin", "up.pin", bool, "give each worker its own CPU cores"),
    Option("--worker-arg", "up.worker_args", action="append", metavar="FLAG", to_config=tuple,
           to_flag=list,
           help="an extra flag for every worker, e.g. --worker-arg=--kv-lease-seconds=10"),
    Option("--worker-api-key", "up.worker_api_key",
           help="the workers' API key (default: a random one only the router knows; visible in "
                "ps: prefer $HEARTH_WORKER_API_KEY or --worker-api-key-file)",
           file_help="read the workers' API key from this file"),
    Option("--startup-timeout", "up.startup_timeout_seconds", float),
    Option("--log-dir", "up.log_dir", help="worker logs go here instead of this terminal"),
    Option("--max-restarts", "up.supervisor.max_restarts", int,
           "restarts of one worker within --restart-window before hearth up gives up and exits 1 "
           "(default: %(default)s)"),
    Option("--restart-window", "up.supervisor.window_seconds", float, metavar="SECONDS"),
    Option("--restart-backoff", "up.supervisor.backoff_seconds", float, metavar="SECONDS",
           help="pause before a restart, doubled per restart in the window (default: "
                f"%(default)s, at most {SupervisorConfig.max_backoff_seconds:g})"),
)),)


def add_up_args(p: argparse.ArgumentParser) -> None:
    _add_groups(p, UP_OPTIONS)


def up_config(a: argparse.Namespace) -> UpConfig:
    return UpConfig(**_kwargs(UpConfig, _field_values(_options(UP_OPTIONS), a), "up."))


def add_cluster_args(p: argparse.ArgumentParser, full: bool = True) -> None:
    """`hearth up --cluster ...` (and `hearth scale`'s way to the same deployment)."""
    c = ClusterConfig()
    g = p.add_argument_group("cluster (Ray; pip install 'hearth[ray]')")
    g.add_argument("--cluster", default=None if full else c.address, metavar="ADDRESS",
                   help="run on a Ray cluster: auto ($RAY_ADDRESS, else the local head) or its "
                        "address (host:port or ray://host:port)" + (
                            "; without it hearth up runs on this machine alone" if full else ""))
    g.add_argument("--cluster-name", default=c.name,
                   help="the deployment's name on the cluster (default: %(default)s)")
    if not full:
        return
    g.add_argument("--cpus-per-rank", type=float, default=c.cpus_per_rank,
                   help="logical CPUs each rank of a worker reserves in Ray (placement only; "
                        "not its compute threads)")
    g.add_argument("--gpus-per-rank", type=float, default=c.gpus_per_rank)
    g.add_argument("--memory-per-rank-gb", type=float, default=0.0,
                   help="memory each rank reserves in Ray (0: none)")
    g.add_argument("--threads-per-worker", type=int, default=c.threads_per_worker,
                   help="compute threads of each worker (0: torch's default)")
    for role, flag in (("prefill", "--prefill-tp"), ("decode", "--decode-tp"),
                       ("both", "--workers-tp")):
        g.add_argument(flag, type=int, default=None, metavar="T",
                       help=f"tensor parallel size of the {role} workers (default: -tp)")
    g.add_argument("--stage-placement", default="pack",
                   choices=[x.lower().replace("_", "-") for x in STAGE_STRATEGIES],
                   help="how a worker's pipeline stages (-pp > 1) are placed: pack (one node if "
                        "it has room), spread, strict-spread (each stage on its own node)")
    g.add_argument("--no-replace", action="store_true",
                   help="do not replace a worker that dies (its role's target drops by one)")
    g.add_argument("--drain-timeout", type=float, default=c.drain_timeout_seconds,
                   metavar="SECONDS", help="a draining worker is stopped after this regardless")
    auto = c.autoscale
    for role, flag in (("prefill", "--autoscale-prefill"), ("decode", "--autoscale-decode"),
                       ("both", "--autoscale-workers")):
        g.add_argument(flag, type=_min_max, default=None, metavar="MIN:MAX",
                       help=f"the {role} workers follow the router's load between MIN and MAX")
    g.add_argument("--autoscale-target-requests", type=float, default=auto.target_requests,
                   metavar="N", help="requests open per worker the autoscaler aims at "
                                     "(default: %(default)s)")
    g.add_argument("--autoscale-upscale-delay", type=float, default=auto.upscale_delay_seconds,
                   metavar="SECONDS", help="more workers only once wanted this long "
                                           "(default: %(default)s)")
    g.add_argument("--autoscale-downscale-delay", type=float,
                   default=auto.downscale_delay_seconds, metavar="SECONDS",
                   help="fewer workers only once wanted this long (default: %(default)s)")


def _min_max(text: str) -> tuple[int, int]:
    low, sep, high = text.partition(":")
    if not sep or not low.strip().isdigit() or not high.strip().isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: expected MIN:MAX, e.g. 1:4")
    return int(low), int(high)


def cluster_config(a: argparse.Namespace) -> ClusterConfig:
    if not hasattr(a, "cpus_per_rank"):  # hearth scale
        return ClusterConfig(address=a.cluster, name=a.cluster_name)
    tp = {role: t for role, t in (("prefill", a.prefill_tp), ("decode", a.decode_tp),
                                  ("both", a.workers_tp)) if t is not None}
    ranges = {role: r for role, r in (("prefill", a.autoscale_prefill),
                                      ("decode", a.autoscale_decode),
                                      ("both", a.autoscale_workers)) if r is not None}
    autoscale = AutoscaleConfig(ranges=ranges, target_requests=a.autoscale_target_requests,
                                upscale_delay_seconds=a.autoscale_upscale_delay,
                                downscale_delay_seconds=a.autoscale_downscale_delay)
    return ClusterConfig(
        address=a.cluster, name=a.cluster_name, cpus_per_rank=a.cpus_per_rank,
        gpus_per_rank=a.gpus_per_rank, memory_per_rank_bytes=int(a.memory_per_rank_gb * 2**30),
        threads_per_worker=a.threads_per_worker, role_tensor_parallel=tp,
        stage_strategy=a.stage_placement.upper().replace("-", "_"),
        replace_dead_workers=not a.no_replace, drain_timeout_seconds=a.drain_timeout,
        autoscale=autoscale)


def add_scale_args(p: argparse.ArgumentParser) -> None:
    add_cluster_args(p, full=False)
    g = p.add_argument_group("targets (only the roles given change)")
    g.add_argument("--prefill", type=int, default=None, help="prefill workers")
    g.add_argument("--decode", type=int, default=None, help="decode workers")
    g.add_argument("--workers", type=int, default=None, help="monolithic workers (role both)")
    g.add_argument("--wait", action="store_true",
                   help="return once the deployment serves exactly these targets")
    g.add_argument("--timeout", type=float, default=600.0, help="with --wait: give up after this")


def up_worker_server_config(a: argparse.Namespace) -> ServerConfig:
    """What every `hearth up` worker's server gets from up's flags (its address is up's choice;
    up has no server flags of its own but the ones it shares with the router). Its workers
    keep the router's timeouts but no per-address cap: every hop comes from the router's."""
    return ServerConfig(served_model_names=_names(a.served_model_name),
                        max_waiting=a.max_waiting, max_body_bytes=_mb_to_bytes(a.max_body_mb),
                        access_log=not a.no_access_log,
                        doorway=doorway_config(a, max_connections_per_ip=0))

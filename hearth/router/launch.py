"""`hearth route` and `hearth up`: flags -> RouterConfig, and running the router under uvicorn.

`register(subparsers, add_engine_args, engine_config)` adds both sub-commands to hearth/cli.py.
`python -m hearth.router.launch --decode URL ...` runs the router without the top-level CLI.
"""

from __future__ import annotations

import argparse
import logging
import sys

from hearth.router.hops import HopTimeouts
from hearth.router.policy import POLICIES, PolicyConfig
from hearth.router.router_config import HealthConfig, RouterConfig


def add_router_args(p: argparse.ArgumentParser, with_block_size: bool = True) -> None:
    """Flags shared by `route` and `up` (policy, health, timeouts, the router's own address)."""
    policy, health, timeouts = PolicyConfig(), HealthConfig(), HopTimeouts()
    g = p.add_argument_group("router")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None,
                   help="clients must send 'Authorization: Bearer KEY' (visible in ps: prefer "
                        "$HEARTH_API_KEY or --api-key-file)")
    g.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="read the API key from this file")
    g.add_argument("--policy", default=policy.name, choices=POLICIES,
                   help="cost: token- and cache-aware (default); round_robin: the cache-blind baseline")
    if with_block_size:
        g.add_argument("--block-size", type=int, default=policy.block_size,
                       help="the workers' KV block size (the router hashes prompts the same way)")
    g.add_argument("--disagg-threshold", type=float, default=policy.disagg_threshold,
                   help="skip the prefill hop when the decode endpoint holds at least this "
                        "fraction of the prompt (1.0: only when it holds all of it)")
    g.add_argument("--min-disagg-tokens", type=int, default=policy.min_disagg_tokens,
                   help="shorter prompts are prefilled by the decode endpoint itself")
    g.add_argument("--prefill-weight", type=float, default=policy.prefill_weight)
    g.add_argument("--decode-weight", type=float, default=policy.decode_weight)
    g.add_argument("--transfer-weight", type=float, default=policy.transfer_weight)
    g.add_argument("--affinity-max-cost-ratio", type=float, default=policy.affinity_max_cost_ratio,
                   help="a session's endpoints are left when they cost more than this times the best")
    g.add_argument("--health-interval", type=float, default=health.interval_seconds,
                   help="seconds between /load polls of each endpoint")
    g.add_argument("--health-timeout", type=float, default=health.timeout_seconds,
                   help="a slower /load answer is a stale load report: the endpoint stays in and "
                        "its polls back off (a refused connection or an error status takes it out)")
    g.add_argument("--eject-seconds", type=float, default=health.eject_seconds)
    g.add_argument("--max-retries", type=int, default=health.max_retries)
    g.add_argument("--connect-timeout", type=float, default=timeouts.connect)
    g.add_argument("--request-timeout", type=float, default=timeouts.request)
    g.add_argument("--stream-idle-timeout", type=float, default=timeouts.stream_idle)
    g.add_argument("--max-body-mb", type=float, default=RouterConfig.max_body_bytes / 2**20,
                   help="larger request bodies get 413")
    g.add_argument("--show-worker-urls", action="store_true",
                   help="list worker URLs on /load even without --api-key (with a key they are "
                        "shown to key holders)")
    g.add_argument("--log-level", default="info")


def add_route_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = p.add_argument_group("endpoints")
    g.add_argument("--prefill", nargs="+", action="extend", default=[], metavar="URL",
                   help="prefill-role workers (hearth serve --role prefill)")
    g.add_argument("--decode", nargs="+", action="extend", default=[], metavar="URL",
                   help="decode-role workers (hearth serve --role decode)")
    g.add_argument("--worker", nargs="+", action="extend", default=[], metavar="URL",
                   help="monolithic workers (hearth serve, role both)")
    g.add_argument("--worker-api-key", default=None,
                   help="the key the router sends to workers (prefer $HEARTH_WORKER_API_KEY)")
    g.add_argument("--worker-api-key-file", default=None, metavar="PATH",
                   help="read the workers' key from this file")
    g.add_argument("--model", default=None,
                   help="tokenize in the router with this model's tokenizer (built-in name, "
                        ".gguf or HF folder); without it the router asks a worker's /tokenize")
    g.add_argument("--served-model-name", default=None)
    add_router_args(p)
    return p


def router_config(a: argparse.Namespace, prefill: list[str], decode: list[str], workers: list[str],
                  worker_api_key: str | None, tokenizer_model: str | None) -> RouterConfig:
    policy = PolicyConfig(
        name=a.policy, block_size=a.block_size, prefill_weight=a.prefill_weight,
        decode_weight=a.decode_weight, transfer_weight=a.transfer_weight,
        disagg_threshold=a.disagg_threshold, min_disagg_tokens=a.min_disagg_tokens,
        affinity_max_cost_ratio=a.affinity_max_cost_ratio)
    return RouterConfig(
        prefill=tuple(prefill), decode=tuple(decode), workers=tuple(workers), host=a.host,
        port=a.port, api_key=a.api_key, worker_api_key=worker_api_key,
        served_model_name=getattr(a, "served_model_name", None), tokenizer_model=tokenizer_model,
        log_level=a.log_level, policy=policy, max_body_bytes=int(a.max_body_mb * 2**20),
        show_worker_urls=a.show_worker_urls,
        health=HealthConfig(interval_seconds=a.health_interval, eject_seconds=a.eject_seconds,
                            max_retries=a.max_retries, timeout_seconds=a.health_timeout),
        timeouts=HopTimeouts(connect=a.connect_timeout, request=a.request_timeout,
                             stream_idle=a.stream_idle_timeout))


def load_tokenizer(model: str | None):
    if model is None:
        return None
    from hearth.engine.tokenizer import Tokenizer
    from hearth.models.loader import load_checkpoint

    return Tokenizer.from_checkpoint(load_checkpoint(model))


def run_router(config: RouterConfig, supervisor=None) -> int:
    """Serve until interrupted (0). Under `hearth up`, `supervisor` (hearth.router.supervisor)
    shows its state in /health and stops the router when it gives up on a worker (1)."""
    import uvicorn

    from hearth.router.app import build_app

    logging.basicConfig(level=config.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per hop is noise
    app = build_app(config, load_tokenizer(config.tokenizer_model),
                    supervisor_state=supervisor.state if supervisor else None)
    logging.getLogger("hearth.router").info(
        "router on http://%s:%d (prefill %s, decode %s, workers %s, policy %s)", config.host,
        config.port, list(config.prefill), list(config.decode), list(config.workers),
        config.policy.name)
    server = uvicorn.Server(uvicorn.Config(
        app, host=config.host, port=config.port, log_level=config.log_level.lower(),
        access_log=False, timeout_graceful_shutdown=5))
    if supervisor is not None:
        supervisor.watch(on_give_up=lambda: setattr(server, "should_exit", True))
    server.run()
    return 1 if supervisor is not None and supervisor.gave_up else 0


def route_main(a: argparse.Namespace) -> int:
    if not a.decode and not a.worker:
        raise ValueError("hearth route needs at least one --decode or --worker URL")
    if a.prefill and not a.decode:
        raise ValueError("--prefill endpoints need --decode endpoints to hand their KV to")
    return run_router(router_config(a, a.prefill, a.decode, a.worker, a.worker_api_key, a.model))


def register(subparsers, add_engine_args, engine_config) -> None:
    """Add `route` and `up` to hearth's CLI (`engine_config` is unused: workers parse their own)."""
    route = subparsers.add_parser("route", help="the token-aware PD router in front of workers")
    add_route_args(route)
    route.set_defaults(func=route_main)

    from hearth.router.up import add_up_args, up_main

    up = subparsers.add_parser("up", help="router + prefill pool + decode pool on this machine")
    add_engine_args(up)
    add_up_args(up)
    add_router_args(up, with_block_size=False)  # --block-size comes with the engine flags
    up.set_defaults(func=up_main)


def main(argv: list[str] | None = None) -> int:
    """`python -m hearth.router.launch --decode URL ...`: the router alone (`hearth up` is in
    hearth/cli.py, which owns the engine flags)."""
    from hearth.cli import read_secrets  # the module that reads flags and the environment

    parser = add_route_args(argparse.ArgumentParser(prog="hearth route", description=__doc__))
    args = parser.parse_args(argv)
    try:
        read_secrets(args)
        return route_main(args)
    except ValueError as exc:
        print(f"hearth route: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""`hearth`'s command line: the one module that reads flags (and the environment they fall back to).

Every sub-command's flags are declared here and mapped onto frozen configs here and nowhere
else: `engine_config` (hearth/config.py), `server_config` (hearth/server/server_config.py),
`router_config` and `up_config` (hearth/router/router_config.py). The layers below take configs
only: `serve(EngineConfig, ServerConfig)` (hearth/server/worker_launch.py), `route(RouterConfig)`
(hearth/router/router_launch.py) and `up(UpConfig, ...)` (hearth/router/up.py) parse nothing and never
import this module. The sub-commands themselves (what each one runs) are hearth/cli.py's.

The package: `options.py` (the `Option` row and what reads rows), `serve.py` (`hearth serve`'s
rows, its configs and `serve_argv`, the torchrun environment), `router.py` (`hearth route`'s,
`hearth up`'s, the cluster's and `hearth scale`'s), and here the parser of every sub-command and
the secrets. Import from `hearth.flags`, not from its modules.

Each option is declared once, as one `Option` row: its flag, the config field it sets (a path
such as "engine.scheduler.max_num_seqs") and, for the few whose flag value is not the field's
value as it is, a converter each way (MB <-> bytes, a comma list <-> a tuple, `--no-X` <-> `X`).
Everything else is read off the rows: the argparse declarations (the default is the field's own
unless the row says otherwise), the Namespace -> config mappings, and, for `hearth serve`
(SERVE_OPTIONS), the config -> argv mapping `serve_argv` with which `hearth up` and the cluster
start each worker. That argv is parsed back and compared, so a setting no flag carries is an
error, never silently dropped; tests/unit/test_serve_options.py fails when a field of
EngineConfig or ServerConfig is neither set by a row nor listed there as flagless.

The rows live in tables here, keyed by config path, in --help order, rather than as metadata on
the config fields: the configs are read by the engine, the server and tests that never parse a
flag, while help texts, choices and converters are the command line's business (STYLE: flags
are read in one module). Nor is the mapping one flag -> one config: --served-model-name sets the
engine's name and the server's list, --max-waiting sits with the engine flags but is the
server's, and the router and `hearth up` take the engine's --model and --block-size.

Still declared by hand: the cluster's and `hearth scale`'s flags (`add_cluster_args`, whose
values are reshaped: per-role maps, MIN:MAX ranges), `hearth route`'s worker URLs and key
(`router_config`'s arguments), and `hearth generate`'s and `hearth bench`'s own flags.

The torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) is read here
too, by `torchrun_env`: under a launcher, rank 0 runs the command as the driver and every other
rank serves the driver's steps instead (hearth/cli.py's `main` decides which).

Secrets (`--api-key`, `--worker-api-key`, `--kv-secret`) are read here too, by `read_secrets`:
works but is visible to every local user in `ps` (so it logs a warning). `hearth up` hands its
workers their secrets through the environment, never on their command lines.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from hearth.config import DEFAULT_MODEL
from hearth.flags.options import FROM_CONFIG, Option, add_secret_args
from hearth.flags.router import (ROUTE_MODEL_OPTIONS, ROUTER_OPTIONS, UP_OPTIONS, add_cluster_args,
                                 add_route_args, add_router_args, add_scale_args, add_up_args,
                                 cluster_config, router_config, up_config,
                                 up_worker_server_config)
from hearth.flags.serve import (ENGINE_OPTIONS, SERVE_OPTIONS, SERVE_SPECULATIVE_METHOD,
                                SERVER_OPTIONS, add_engine_args, add_serve_args,
                                add_server_args, doorway_config, engine_config, serve_argv,
                                serve_parser, server_config, torchrun_env,
                                up_engine_config)

__all__ = ["ENGINE_OPTIONS", "FROM_CONFIG", "Option", "ROUTER_OPTIONS", "ROUTE_MODEL_OPTIONS",
           "SECRET_ENV", "SERVER_OPTIONS", "SERVE_OPTIONS", "SERVE_SPECULATIVE_METHOD",
           "UP_OPTIONS", "add_cluster_args", "add_engine_args", "add_route_args",
           "add_router_args", "add_scale_args", "add_secret_args", "add_serve_args",
           "add_server_args", "add_up_args", "build_parser", "cluster_config", "doorway_config",
           "engine_config", "read_secrets", "router_config", "serve_argv", "serve_parser",
           "server_config", "torchrun_env", "up_config", "up_engine_config",
           "up_worker_server_config"]



def build_parser() -> argparse.ArgumentParser:
    """`hearth` with every sub-command and its flags (the command's name is `command`)."""
    parser = argparse.ArgumentParser(prog="hearth", description="LLM serving for AI agents")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="offline generation, all prompts as one batch")
    add_engine_args(gen)
    gen.add_argument("prompts", nargs="+")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--chat", action="store_true", help="apply the chat template to each prompt")
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt per line")

    serve = sub.add_parser("serve", help="an OpenAI-compatible worker for one model")
    add_serve_args(serve)

    route = sub.add_parser("route", help="the token-aware PD router in front of workers")
    add_route_args(route)

    up = sub.add_parser("up", help="router + prefill pool + decode pool on this machine "
                                   "(or on a Ray cluster: --cluster)")
    add_engine_args(up)
    add_up_args(up)
    add_cluster_args(up)
    add_router_args(up, with_block_size=False)  # --block-size comes with the engine flags

    scale = sub.add_parser("scale", help="change the workers of a running cluster deployment "
                                         "(hearth up --cluster)")
    add_scale_args(scale)

    bench = sub.add_parser("bench", help="engine benchmark: cold start, prefill and decode "
                                         "tokens/s (beside transformers), printed as a table")
    bench.add_argument("--model", default=DEFAULT_MODEL)
    bench.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    bench.add_argument("--prefill-tokens", type=int, default=2048)
    bench.add_argument("--new-tokens", type=int, default=64, help="output tokens per stream")
    bench.add_argument("--batches", default="1,8,32", help="stream counts for decode, comma-separated")
    bench.add_argument("--quick", action="store_true", help="512-token prefill, 16 new tokens")
    bench.add_argument("--compare", choices=["transformers", "none"], default="transformers")
    bench.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    bench.add_argument("--plot", metavar="PATH", help="also write a PNG bar chart")
    return parser


# The secret flags (argparse dests) and the environment variable each one falls back to.
SECRET_ENV = {"api_key": "HEARTH_API_KEY", "worker_api_key": "HEARTH_WORKER_API_KEY",
              "kv_secret": "HEARTH_KV_SECRET"}


def read_secrets(a: argparse.Namespace, environ=None) -> None:
    """Fill every secret flag `a` has (see SECRET_ENV) from its file, its environment variable
    or the flag itself; at most one of the flag and its file may be given. Sets `NAME` on `a`
    (None when no source has it) and drops nothing else."""
    environ = os.environ if environ is None else environ
    for dest, env_name in SECRET_ENV.items():
        if not hasattr(a, dest):
            continue
        flag = "--" + dest.replace("_", "-")
        value, path = getattr(a, dest), getattr(a, dest + "_file", None)
        if value is not None and path is not None:
            raise ValueError(f"give {flag} or {flag}-file, not both")
        if path is not None:
            try:
                value = Path(path).read_text().strip()
            except OSError as exc:
                raise ValueError(f"{flag}-file: cannot read {path}: {exc.strerror}") from None
            if not value:
                raise ValueError(f"{flag}-file: {path} is empty")
        elif value is not None:
            logging.getLogger("hearth").warning(
                "%s on the command line is visible to every local user (ps); prefer $%s or "
                "%s-file", flag, env_name, flag)
        else:
            value = environ.get(env_name) or None
        setattr(a, dest, value)

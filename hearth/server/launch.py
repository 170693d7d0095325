"""`hearth serve`: the worker's flags, and running it under uvicorn.

`register(subparsers, add_engine_args, engine_config)` adds `serve` to hearth/cli.py, which owns
the engine flags and their mapping onto EngineConfig; this module adds only the server's own
flags (`add_server_args`) and maps them onto ServerConfig.

`python -m hearth.server.launch ...` takes the same flags as `hearth serve` (the e2e tests and
`hearth up` start workers this way). It borrows the engine flags from hearth/cli.py at run
time: an entry point, not an import of the layer (the module imports nothing above it).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from typing import Callable

import uvicorn

from hearth.config import EngineConfig
from hearth.server.app import build_app
from hearth.server.server_config import ServerConfig


def add_server_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    defaults = ServerConfig()
    g = parser.add_argument_group("server")
    g.add_argument("--host", default=defaults.host)
    g.add_argument("--port", type=int, default=defaults.port)
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (visible in ps: prefer "
                        "$HEARTH_API_KEY or --api-key-file)")
    g.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="read the API key from this file")
    g.add_argument("--tool-call-parser", default=defaults.tool_call_parser,
                   help="auto (by model family) | hermes | llama3_json")
    g.add_argument("--no-guided-auto-tools", action="store_true",
                   help="do not constrain tool-call arguments under tool_choice=auto")
    g.add_argument("--max-body-mb", type=float, default=defaults.max_body_bytes / 2**20,
                   help="larger request bodies get 413")
    g.add_argument("--log-level", default=defaults.log_level)
    return parser


def server_config(args: argparse.Namespace, engine: EngineConfig) -> ServerConfig:
    return ServerConfig(
        host=args.host, port=args.port, served_model_name=engine.model.served_model_name,
        api_key=args.api_key, max_waiting=engine.scheduler.max_waiting,
        max_body_bytes=int(args.max_body_mb * 2**20), tool_call_parser=args.tool_call_parser,
        guided_auto_tools=not args.no_guided_auto_tools, log_level=args.log_level,
    )


def serve_main(args: argparse.Namespace, engine_config: EngineConfig) -> int:
    """Run the worker until interrupted; exit code 1 if its engine failed or died."""
    config = server_config(args, engine_config)
    logging.basicConfig(level=config.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    server: uvicorn.Server | None = None

    def stop() -> None:  # the engine is gone: finish in-flight responses, then exit
        if server is not None:
            server.should_exit = True

    app = build_app(engine_config, config, on_fatal=stop)
    server = uvicorn.Server(uvicorn.Config(
        app, host=config.host, port=config.port, log_level=config.log_level.lower(),
        access_log=False, timeout_graceful_shutdown=5))
    server.run()
    return 1 if app.state.worker.failure else 0


def register(subparsers, add_engine_args: Callable, engine_config: Callable) -> None:
    """Add `serve` to hearth's CLI."""
    serve = subparsers.add_parser("serve", help="an OpenAI-compatible worker for one model")
    add_engine_args(serve)
    add_server_args(serve)
    serve.set_defaults(func=lambda args: serve_main(args, engine_config(args)))


def _cli():
    """hearth/cli.py, the module that owns the engine flags (see the module docstring)."""
    return importlib.import_module("hearth.cli")


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Every flag `hearth serve` takes (engine + server), e.g. for `hearth up` to forward."""
    _cli().add_engine_args(parser)
    return add_server_args(parser)


def main(argv: list[str] | None = None) -> int:
    parser = add_serve_args(argparse.ArgumentParser(prog="hearth serve", description=__doc__))
    args = parser.parse_args(argv)
    try:
        _cli().read_secrets(args)
        return serve_main(args, _cli().engine_config(args))
    except (ValueError, FileNotFoundError) as exc:
        print(f"hearth serve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""The engine-core process of every worker: `python -m hearth.server.core_main --fd N`.

The server (hearth/server/engine_client.py) starts this module, the core loop itself is
hearth/engine/core_process.py. The entry point sits in the server layer because choosing the
KV connector by role is the server's: prefill and decode engines get hearth.kv_transfer's, a
monolithic one none (the engine layer may not import hearth.kv_transfer or hearth.kv_tiers). Its argv is internal (the
inherited socket and a log level), not user flags: those are hearth/flags/'s.

Exit codes: 0 the server closed the socket or sent Shutdown; 1 the engine failed to start (or an
uncaught error before the loop); 2 the first message was not StartEngine; 3 the engine's rank set
was lost; 4 the core loop failed (every open request was ended with the error first).
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys
import time

from hearth.config import EngineConfig, Role
from hearth.engine.core_process import run_core
from hearth.logs import setup_logging


def connector_factory_for(config: EngineConfig):
    """The KV connector factory an engine of this role gets (None: role both, no connector)."""
    if config.kv_transfer.role is Role.BOTH:
        return None
    from hearth.kv_transfer.connector import make_connector  # torch: only in the core process

    return make_connector


def store_factory_for(config: EngineConfig):
    """The KV-tier store factory (hearth.kv_tiers.store), when --kv-offload-* asks for tiers."""
    if not config.kv_offload.enabled:
        return None
    from hearth.kv_tiers.store import make_store  # torch: only in the core process

    return make_store


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="hearth engine core (started by the server)")
    parser.add_argument("--fd", type=int, required=True, help="inherited socketpair end")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    setup_logging(args.log_level)
    # Ctrl-C reaches the whole process group: this process stops when its server says so
    # (Shutdown) or closes the socket, never half-way through the server's own shutdown.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    t0 = time.monotonic()
    import hearth.engine.engine  # noqa: F401  torch and the engine: most of a cold start's CPU

    logging.getLogger("hearth.core").info("engine core: imports took %.2fs",
                                          time.monotonic() - t0)
    sock = socket.socket(fileno=args.fd)
    try:
        return run_core(sock, connector_factory_for, store_factory_for)
    except ConnectionError:  # EngineReady found the server gone (it failed to start, e.g. its port)
        logging.getLogger("hearth.core").info("server closed the engine socket before the "
                                              "engine was ready; exiting")
        return 0
    finally:
        sock.close()


if __name__ == "__main__":
    sys.exit(main())

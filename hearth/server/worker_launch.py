"""`hearth serve`: one worker (this HTTP server + its engine-core process) under uvicorn.

`serve(EngineConfig, ServerConfig)` is a plain function over the worker's two configs: it parses
nothing. The flags that build them are hearth/flags/'s (the one module that reads flags);
hearth/cli.py calls this for `hearth serve`; `hearth up` starts each of its workers as `hearth
serve` too.
"""

from __future__ import annotations

import uvicorn

from hearth.api.edge import bound_heap, uvicorn_config
from hearth.config import EngineConfig
from hearth.logs import setup_logging
from hearth.server.worker_app import build_app
from hearth.server.engine_client import CoreProcess
from hearth.server.server_config import ServerConfig


def serve(engine_config: EngineConfig, config: ServerConfig, core: CoreProcess | None = None) -> int:
    """Run the worker until interrupted; exit code 1 if its engine failed or died. `core`: its
    engine-core process, if the caller spawned it already (`spawn_core`), else started here."""
    setup_logging(config.log_level)
    bound_heap()
    server: uvicorn.Server | None = None

    def stop() -> None:  # the engine is gone: finish in-flight responses, then exit
        if server is not None:
            server.should_exit = True

    app = build_app(engine_config, config, on_fatal=stop, core=core)
    server = _Server(uvicorn_config(app, config.host, config.port, config.log_level,
                                    config.doorway))
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it handled, once it has shut down
        pass
    return 1 if app.state.worker.failure else 0


class _Server(uvicorn.Server):
    """uvicorn's server, telling the engine client on SIGINT/SIGTERM that a shutdown began:
    the engine core ending from then on is expected, not a failure (no ERROR, exit code 0)."""

    def handle_exit(self, sig, frame) -> None:
        self.config.app.state.worker.engine.begin_shutdown()
        super().handle_exit(sig, frame)


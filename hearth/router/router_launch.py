"""`hearth route`: the router under uvicorn, from its RouterConfig.

`route(RouterConfig)` is a plain function: it parses nothing. The flags that build the config are
hearth/flags/'s (the one module that reads flags); `hearth up` (hearth/router/up.py) calls
`route` too, once its workers are healthy, with their URLs in the config.
"""

from __future__ import annotations

import logging

from hearth.logs import setup_logging
from hearth.router.router_config import RouterConfig


def load_tokenizer(model: str | None):
    if model is None:
        return None
    from hearth.engine.text.tokenizer import Tokenizer
    from hearth.models.loader import load_tokenizer_source

    return Tokenizer.from_source(load_tokenizer_source(model))  # no torch in the router


def route(config: RouterConfig, supervisor=None, registry=None) -> int:
    """Serve until interrupted (0). Under `hearth up`, `supervisor` (hearth.router.supervisor,
    or a cluster deployment's controller) shows its state in /health and stops the router when
    it gives up on a worker (1). `registry`: discovery of the workers at run time
    (hearth/router/discovery.py) instead of the config's URLs."""
    import uvicorn

    from hearth.api.edge import bound_heap, uvicorn_config
    from hearth.router.router_app import build_app

    setup_logging(config.log_level)
    bound_heap()
    app = build_app(config, load_tokenizer(config.tokenizer_model),
                    supervisor_state=supervisor.state if supervisor else None, registry=registry)
    logging.getLogger("hearth.router").info(
        "router on http://%s:%d (prefill %s, decode %s, workers %s, policy %s)", config.host,
        config.port, *(("discovered",) * 3 if registry is not None else
                       (list(config.prefill), list(config.decode), list(config.workers))),
        config.policy.name)
    server = uvicorn.Server(uvicorn_config(app, config.host, config.port, config.log_level,
                                          config.doorway))
    if supervisor is not None:
        supervisor.watch(on_give_up=lambda: setattr(server, "should_exit", True))
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it handled, once it has shut down
        pass
    return 1 if supervisor is not None and supervisor.gave_up else 0


"""One log format for every hearth process: `hearth serve`, its engine-core process, the
parallel ranks, the router, and `hearth up` with its children (which are `hearth serve`s).

    2026-12-01 12:00:00,123 INFO hearth.server: serving smollm2-135m-instruct on http://...

uvicorn's own loggers (`uvicorn.error`: startup, shutdown) are left unconfigured by uvicorn
(`log_config=None` where it is started) so their lines come out in this format too.
"""

from __future__ import annotations

import logging
import sys

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging(level: str | int = "info", tag: str | None = None) -> None:
    """Route every logger of this process to stderr in LOG_FORMAT, at `level`; `tag` marks
    the process after the logger name (a parallel rank: "hearth.engine[rank1]: ...")."""
    if isinstance(level, str):
        level = level.upper()
    fmt = LOG_FORMAT if tag is None else LOG_FORMAT.replace("%(name)s", f"%(name)s[{tag}]")
    logging.basicConfig(level=level, stream=sys.stderr, format=fmt, force=True)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per hop and poll is noise

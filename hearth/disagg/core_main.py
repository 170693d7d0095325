"""The engine-core process of a prefill or decode worker: `python -m hearth.disagg.core_main`.

Same as `hearth.engine.core_process` (same flags, same messages), but its engine gets the
disaggregation connector. It lives here because the engine layer may not import `hearth.disagg`;
the server starts this module instead of the plain core when `--role` is prefill or decode.
"""

from __future__ import annotations

import sys

from hearth.disagg.connector import make_connector
from hearth.engine import core_process

if __name__ == "__main__":
    sys.exit(core_process.main(connector_factory=make_connector))

"""Engine benchmark: hearth vs HF transformers `generate`, same machine, same run, same weights.

    .venv/bin/python benchmarks/engine.py [--quick] [--dtype float32|bfloat16] [--new-tokens N]

The same as `hearth bench` (the measuring code is hearth/bench/engine_bench.py; the flags are
hearth/flags/'s), writing benchmarks/results/engine.json and engine.png as well: cold start
(process start to ready), prefill tokens/s on a ~2k-token prompt, and decode tokens/s at
batch 1, 8 and 32, each beside transformers' and with the ratio. Decode throughput is (tokens
after the first) / (time after the prefill), so prompt processing does not pollute it.
"""

from __future__ import annotations

import sys
from pathlib import Path

from hearth.cli import main

RESULTS = Path(__file__).parent / "results"

if __name__ == "__main__":
    RESULTS.mkdir(exist_ok=True)
    sys.exit(main(["bench", "--json", str(RESULTS / "engine.json"),
                   "--plot", str(RESULTS / "engine.png"), *sys.argv[1:]]))

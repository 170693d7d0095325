"""Cold-start cost of turning `--model` into (ModelArch, float32 weights, Tokenizer).

Each trial runs in a fresh interpreter (imports included, as at server start; the file itself is
in the page cache after the first trial). Prints one row per phase: median and min over trials.

    python benchmarks/load_time.py [--model smollm2-135m-instruct] [--trials 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

TRIAL = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
from hearth.engine.tokenizer import Tokenizer
from hearth.models.loader import load_checkpoint
t2 = time.perf_counter()
ckpt = load_checkpoint(sys.argv[1])
t3 = time.perf_counter()
tokenizer = Tokenizer.from_checkpoint(ckpt)
t4 = time.perf_counter()
weights = {name: ckpt.get(name) for name in ckpt.tensor_names()}
t5 = time.perf_counter()
num_params = sum(w.numel() for w in weights.values())
print(json.dumps({"import torch": t1 - t0, "import hearth": t2 - t1, "open checkpoint": t3 - t2,
                  "tokenizer": t4 - t3, "materialize tensors": t5 - t4,
                  "load total (excl. torch import)": t5 - t1, "params": num_params}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--trials", type=int, default=5)
    args = parser.parse_args()
    runs = []
    for _ in range(args.trials):
        out = subprocess.run([sys.executable, "-c", TRIAL, args.model], capture_output=True, text=True, check=True)
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"model: {args.model}  params: {runs[0]['params'] / 1e6:.1f}M  trials: {args.trials}")
    print(f"{'phase':<34}{'median s':>10}{'min s':>10}")
    for phase in runs[0]:
        if phase == "params":
            continue
        values = [run[phase] for run in runs]
        print(f"{phase:<34}{statistics.median(values):>10.3f}{min(values):>10.3f}")


if __name__ == "__main__":
    main()

"""Cold-start phases of a worker, as its two processes run them (`hearth serve` defaults).

Each trial runs in a fresh interpreter (imports included, as at server start; the file itself is
in the page cache after the first trial). Prints one row per phase: median and min over trials.
The engine-core rows are what `LLMEngine` does before EngineReady, in its order (tokenizer,
kernels probe + load, float weights, decode-weight packing, KV pool); the HTTP-side rows are
what the server process does beside it (its tokenizer from the GGUF metadata, without torch).
End to end (process start -> first 200 on /health) is `benchmarks/peers.py --figures cold`.

    python benchmarks/load_time.py [--model smollm2-135m-instruct] [--trials 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

CORE_TRIAL = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
from hearth.cli import build_parser, engine_config
from hearth.engine.engine import LLMEngine
from hearth.engine.executor import num_kv_blocks, resolve_formats
from hearth.engine.runner import ModelRunner
from hearth.engine.text.tokenizer import Tokenizer
from hearth.models.loader import load_checkpoint
from hearth.models.quant import quantize_model
from hearth.models.weights import build_model
t = {"core: import torch": t1 - t0, "core: import hearth engine": time.perf_counter() - t1}
def mark(phase, since):
    now = time.perf_counter()
    t[phase] = now - since
    return now
config = engine_config(build_parser().parse_args(["serve", "--model", sys.argv[1]]))
s = start = time.perf_counter()
ckpt = load_checkpoint(config.model.model); s = mark("core: open checkpoint (GGUF header)", s)
tokenizer = Tokenizer.from_checkpoint(ckpt); s = mark("core: tokenizer", s)
dtype, kv_dtype, quantization, kernels = resolve_formats(config, ckpt)
s = mark("core: CPU kernels probe + load", s)
model = build_model(ckpt, dtype); s = mark("core: float weights (dequantize)", s)
if kernels is not None:
    model.use_kernels(kernels)
    quantize_model(model, ckpt, quantization, kernels)
s = mark(f"core: decode weights ({quantization})", s)
blocks = num_kv_blocks(config.cache, ckpt.arch, config.parallel, kv_dtype)
ModelRunner(model, blocks, config.cache.block_size, kv_dtype, "cpu", 0, kernels)
s = mark("core: KV pool + runner", s)
t["core: engine build total"] = s - start
t["params"] = sum(p.numel() for p in model.parameters())
print(json.dumps(t))
"""

HTTP_TRIAL = r"""
import json, sys, time
t0 = time.perf_counter()
from hearth.cli import build_parser, engine_config
from hearth.server import worker_launch
t1 = time.perf_counter()
from hearth.server.worker_app import load_tokenizer
load_tokenizer(engine_config(build_parser().parse_args(["serve", "--model", sys.argv[1]])))
t2 = time.perf_counter()
print(json.dumps({"http: imports (FastAPI, uvicorn, hearth.server)": t1 - t0,
                  "http: tokenizer (GGUF metadata, no torch)": t2 - t1,
                  "http: torch imported": "torch" in sys.modules}))
"""


def run_trial(code: str, model: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code, model], capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--trials", type=int, default=5)
    args = parser.parse_args()
    runs = [{**run_trial(CORE_TRIAL, args.model), **run_trial(HTTP_TRIAL, args.model)}
            for _ in range(args.trials)]
    print(f"model: {args.model}  params: {runs[0]['params'] / 1e6:.1f}M  trials: {args.trials}"
          f"  torch in the HTTP process: {any(r['http: torch imported'] for r in runs)}")
    print(f"{'phase':<52}{'median s':>10}{'min s':>10}")
    for phase in runs[0]:
        if phase in ("params", "http: torch imported"):
            continue
        values = [run[phase] for run in runs]
        print(f"{phase:<52}{statistics.median(values):>10.3f}{min(values):>10.3f}")


if __name__ == "__main__":
    main()

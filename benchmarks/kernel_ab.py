"""Interleaved A/B of CPU kernel builds (issue 31): each build measured in a fresh process per
round, builds taking turns, so a machine whose speed swings by +-20% (a shared 2-core box) hits
every build alike. Prints min and median over the rounds.

    .venv/bin/python benchmarks/kernel_ab.py OLD.so NEW.so [...] [--rounds 3] [--threads 2]
        [--quantization auto] [--json benchmarks/results/kernel_ab.json]

The builds are .so files from hearth/ops/build_kernels.py (copy the old one out of
hearth/ops/_build before a rebuild). Each child preloads its build, and hearth's loader takes it
as the `--cpu-kernels` variant its isa() names (that variant must be usable here).
Per build and round:
* qlinear: one SmolLM2-135M step's linears (benchmarks/kernel_bench.py's weights: 30 layers of
  Q4_1 + the Q8_0 LM head) at M = 1, 2, 4, 8 rows of float32 activations and M = 1 of 8-bit
  ones, on `--threads` threads (the decode runs with as many); best of 5 passes, ms.
* decode: one stream on the default model (~100-token prompt, 128 new tokens, greedy) with
  `--quantization` (auto: the GGUF's own Q4_1/Q8_0 blocks, float32 activations; gguf-a8: 8-bit
  activations), output tok/s as `hearth bench` counts it; 3 runs per child. `--model` decodes
  another model instead (e.g. /tmp/mla-bench, benchmarks/mla_bench.py's, with q8_0 / q8_0-a8).
Writes every sample to `--json`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
ROWS = (1, 2, 4, 8)


def qlinear_ms(threads: int) -> dict[str, float]:
    import torch

    from benchmarks.kernel_bench import q4_1_blocks
    from hearth.models.quant import quantize_q8_0
    from hearth.ops.cpu_kernels import pack_ggml

    gen = torch.Generator().manual_seed(0)
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30
    blocks = [(k, 3, q4_1_blocks(n, k, gen)) for n, k in shapes]
    blocks.append((576, 8, quantize_q8_0(torch.randn(49152, 576, generator=gen))))
    out = {}
    for int8_act, rows_list in ((False, ROWS), (True, (1,))):
        weights = [(k, pack_ggml(qtype, b, int8_act=int8_act)) for k, qtype, b in blocks]
        for rows in rows_list:
            xs = {k: torch.randn(rows, k) for k in (576, 1536)}

            def step():
                for k, w in weights:
                    torch.ops.hearth.qlinear(xs[k], w.qs, w.d, w.m, w.qtype, w.out_features,
                                             w.in_features, threads, int8_act)

            step()
            best = float("inf")
            for _ in range(5):
                t0 = time.perf_counter()
                step()
                best = min(best, time.perf_counter() - t0)
            out[f"qlinear {'int8' if int8_act else 'fp32'} M={rows} (ms)"] = best * 1e3
    return out


def decode_tok_s(variant: str, quantization: str, model: str) -> list[float]:
    from hearth.bench.engine_bench import hearth_decode, make_prompts
    from hearth.engine.llm import LLM

    llm = LLM(model, cpu_kernels=variant, quantization=quantization, max_model_len=4096)
    try:
        prompt = make_prompts(llm.tokenizer, 1, 100)
        hearth_decode(llm, prompt, 16)  # warm-up
        return [hearth_decode(llm, prompt, 128) for _ in range(3)]
    finally:
        llm.engine.close()


def child(build: str, threads: int, quantization: str, model: str) -> None:
    import torch

    from hearth.ops.build_kernels import ISA

    torch.ops.load_library(build)
    variant = {isa: v for v, isa in ISA.items()}[torch.ops.hearth.isa()]
    torch.set_num_threads(threads)
    report = {"variant": variant, **qlinear_ms(threads)}
    report[f"decode 1 stream, {quantization} (tok/s)"] = decode_tok_s(variant, quantization, model)
    print(json.dumps(report))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("builds", nargs="*", help=".so files, measured in this order each round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2,
                    help="torch threads of each child (its qlinear passes and its decode)")
    ap.add_argument("--quantization", default="auto", help="decode weights (hearth serve's flag)")
    ap.add_argument("--model", default="smollm2-135m-instruct",
                    help="the decode's model (e.g. benchmarks/mla_bench.py's folder)")
    ap.add_argument("--json", type=Path, default=RESULTS / "kernel_ab.json")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        child(args.child, args.threads, args.quantization, args.model)
        return
    if not args.builds:
        ap.error("name at least one build (.so)")
    samples: dict[str, dict[str, list[float]]] = {b: {} for b in args.builds}
    variants: dict[str, str] = {}
    for r in range(args.rounds):
        for build in args.builds:
            proc = subprocess.run([sys.executable, __file__, "--child", build, "--threads",
                                   str(args.threads), "--quantization", args.quantization,
                                   "--model", args.model],
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                sys.exit(f"{build}: the child failed:\n{proc.stderr[-3000:]}")
            report = json.loads(proc.stdout.strip().splitlines()[-1])
            variants[build] = report.pop("variant")
            for metric, value in report.items():
                samples[build].setdefault(metric, []).extend(
                    value if isinstance(value, list) else [value])
            print(f"round {r + 1}/{args.rounds}: {Path(build).name} done", file=sys.stderr)
    metrics = list(samples[args.builds[0]])
    print("| metric | " + " | ".join(f"{Path(b).name} ({variants[b]})" for b in args.builds) + " |")
    print("|---|" + "---|" * len(args.builds))
    for metric in metrics:
        cells = [f"{min(samples[b][metric]):.3g} / {statistics.median(samples[b][metric]):.3g}"
                 for b in args.builds]
        print(f"| {metric}, min / median | " + " | ".join(cells) + " |")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(
        {"threads": args.threads, "quantization": args.quantization, "model": args.model,
         "variants": variants,
         "samples": samples}, indent=1))


if __name__ == "__main__":
    main()

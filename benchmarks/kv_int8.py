"""The single-stream decode step at long context with a bfloat16, an int8 and an fp8 (e4m3) KV
cache, against the memory roofline of the bytes each step must read.

    .venv/bin/python benchmarks/kv_int8.py [--contexts 4096 16384 32768] [--repeats 3] [--scatter]
        [--dtypes bfloat16 int8 fp8] [--json benchmarks/results/kv_int8.json]

Model: random weights of SmolLM2-135M's shape (30 layers, hidden 576, 9 heads / 3 KV heads of
64, MLP 1536, vocab 49,152, tied embeddings) with max_position_embeddings 32768, written once
by `write_random_checkpoint`; linear layers in Q8_0 for decode (`--quantization q8_0`: the
random folder has no GGUF blocks), hearth's CPU kernels, one process, no engine around it.

The context's KV is not prefilled: its blocks are filled with random rows in the cache's format
(a 32k-token prefill of this model takes minutes on 2 cores, and the decode step's cost does
not depend on the values it reads). Each measured step is the model's forward for one token at
position `context` (every layer's fused decode kernel: the cache read in place through a block
table) plus the LM head, timed `--steps` times after 3 warm-up steps; the figure per repeat is
the median step, and the table prints min / median over `--repeats`.

Bytes per step: the decode weights (Q8_0 blocks and their scales, fp32 norms) + every layer's
K and V rows of the context (bf16: 2 x 64 x 2 bytes per head and token; int8 and fp8:
2 x (64 + 4), the values and their row's float32 scale).
The memory roofline is those bytes at the machine's streaming read bandwidth (a 1 GiB sum,
best of 5, with torch's threads).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from hearth.config import CacheConfig, EngineConfig, ModelConfig  # noqa: E402
from hearth.engine.executor import make_executor  # noqa: E402
from hearth.models.loader import load_checkpoint  # noqa: E402
from hearth.models.random_checkpoint import write_random_checkpoint  # noqa: E402
from hearth.ops import kv_quant  # noqa: E402
from hearth.ops.attention import build_attention_metadata  # noqa: E402

SHAPE = dict(num_layers=30, hidden_size=576, num_heads=9, num_kv_heads=3, intermediate_size=1536,
             vocab_size=49152, max_position_embeddings=32768, tie_word_embeddings=True)
BLOCK = 16


def read_bandwidth() -> float:
    """GB/s of a streaming read (sum over 1 GiB of fp32, best of 5) with torch's threads."""
    x = torch.ones(2**28)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


def decode_weight_bytes(model) -> int:
    """Bytes a batch-1 step reads of weights: each linear's decode format (its packed blocks
    where quantized, else its float weight) and the norms; the embedding is one row."""
    total = 0
    for module in model.modules():
        qweight = getattr(module, "qweight", None)
        if qweight is not None:
            total += sum(t.numel() * t.element_size() for t in (qweight.qs, qweight.d, qweight.m))
        elif type(module).__name__ == "RMSNorm" or hasattr(module, "set_quantized"):
            total += module.weight.numel() * module.weight.element_size()
    return total


def fill_context(runner, context: int, gen: torch.Generator) -> None:
    """Random K/V rows (unit normal) in the cache's format for blocks [0, context / BLOCK)."""
    kv = runner.kv_cache
    blocks = -(-context // BLOCK)
    for layer in range(kv.shape[0]):
        for plane in range(kv.shape[1]):
            rows = torch.randn(blocks, BLOCK, kv.shape[4], 64, generator=gen)  # head_dim 64
            kv[layer, plane, :blocks] = kv_quant.to_cache(rows, kv.dtype)


def step_times(runner, context: int, steps: int, scatter: bool = False) -> list[float]:
    """Seconds of each decode step at position `context` (after 3 warm-up steps). `scatter`:
    the request's blocks in a random order (a pool after churn), else in pool order."""
    model = runner.model
    table = list(range(context // BLOCK + 1))
    if scatter:
        table = torch.randperm(len(table), generator=torch.Generator().manual_seed(context)).tolist()
    meta = build_attention_metadata([1], [context + 1], [table], BLOCK)
    ids, positions = torch.tensor([7]), torch.tensor([context])
    times = []
    with torch.inference_mode():
        for i in range(steps + 3):
            t = time.perf_counter()
            hidden, _ = model(ids, positions, meta, runner.kv_cache)
            model.compute_logits(hidden)
            if i >= 3:
                times.append(time.perf_counter() - t)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", type=Path, default=Path("/tmp/kv-int8-bench"))
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384, 32768])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "int8", "fp8"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--scatter", action="store_true",
                    help="block tables in random order (a pool after churn), not pool order")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if not (args.model_dir / "model.safetensors").exists():
        write_random_checkpoint(args.model_dir, **SHAPE)
    checkpoint = load_checkpoint(str(args.model_dir))
    bandwidth = read_bandwidth()
    flags = sorted({f for f in Path("/proc/cpuinfo").read_text().split()
                    if f.startswith(("avx512", "amx", "avx2", "fma"))})
    results = {"shape": SHAPE, "scatter": args.scatter, "read_bandwidth_gbs": bandwidth, "cpu_flags": flags,
               "threads": torch.get_num_threads(), "runs": {}}
    num_blocks = max(args.contexts) // BLOCK + 2
    gen = torch.Generator().manual_seed(0)
    for dtype in args.dtypes:
        config = EngineConfig(model=ModelConfig(str(args.model_dir), quantization="q8_0"),
                              cache=CacheConfig(num_blocks=num_blocks, kv_cache_dtype=dtype))
        runner = make_executor(config, checkpoint)
        weights = decode_weight_bytes(runner.model)
        kv = runner.kv_cache
        per_token = kv.shape[0] * kv.shape[1] * kv.shape[4] * kv.shape[5] * kv.element_size()
        for ctx in args.contexts:
            fill_context(runner, ctx, gen)
            medians = [statistics.median(step_times(runner, ctx, args.steps, args.scatter)) * 1000
                       for _ in range(args.repeats)]
            read = weights + ctx * per_token
            results["runs"][f"{dtype}@{ctx}"] = {
                "kv_dtype": dtype, "context": ctx, "step_ms": medians,
                "weight_bytes": weights, "kv_bytes": ctx * per_token, "kv_bytes_per_token": per_token,
                "memory_roofline_ms": read / (bandwidth * 1e9) * 1000}
        runner.close()
        del runner, kv

    print(f"read bandwidth {bandwidth:.1f} GB/s, {results['threads']} threads; CPU flags: "
          f"{' '.join(flags)}")
    print(f"{'KV':>9} {'context':>8} {'step ms min/med':>16} {'KV MB/step':>11} "
          f"{'total MB':>9} {'roofline ms':>12} {'x roofline':>11} {'vs bf16':>8}")
    for key, r in results["runs"].items():
        best, med = min(r["step_ms"]), statistics.median(r["step_ms"])
        base = results["runs"].get(f"bfloat16@{r['context']}")
        speedup = f"{min(base['step_ms']) / best:.2f}x" if base else "-"
        print(f"{r['kv_dtype']:>9} {r['context']:>8} {best:>7.2f} / {med:<7.2f} "
              f"{r['kv_bytes'] / 1e6:>11.1f} {(r['kv_bytes'] + r['weight_bytes']) / 1e6:>9.1f} "
              f"{r['memory_roofline_ms']:>12.2f} {best / r['memory_roofline_ms']:>11.2f} "
              f"{speedup:>8}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

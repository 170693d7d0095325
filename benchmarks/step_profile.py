"""Where one engine step's time goes, against this machine's roofline.

    .venv/bin/python benchmarks/step_profile.py [--quantization auto] [--kv-cache-dtype auto]

Measures the machine (fp32 GEMM GFLOP/s at prefill shape, memory read GB/s), then profiles with
torch.profiler, in the engine alone (no HTTP): one prefill chunk of a 2k-token prompt, and decode
steps at ~100 and ~6,000 tokens of context. Prints per-op tables (self CPU time per step) and what
fraction of the roofline each phase reaches; writes benchmarks/results/step_profile.json.

Then a short-query step (1 + k new tokens of one request, what speculative decoding's verify step
runs) at both contexts, through the model directly: through the kernels' short-query path (one
fused call per layer) and, for comparison, with short queries sent down the prefill path (the
per-request SDPA loop, as before the short-query kernel).
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from hearth.engine.llm import LLM
from hearth.engine.sampling_params import SamplingParams
from hearth.ops import attention

RESULTS = Path(__file__).parent / "results"


def best_of(fn, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def roofline() -> dict:
    x, w = torch.randn(512, 576), torch.randn(3072, 576)
    gemm = 2 * 512 * 576 * 3072 / best_of(lambda: torch.nn.functional.linear(x, w)) / 1e9
    big = torch.randn(64_000_000)
    read = big.numel() * 4 / best_of(lambda: big.sum()) / 1e9
    return {"fp32_gemm_gflops": gemm, "read_gbps": read, "threads": torch.get_num_threads()}


def profile_steps(engine, num_steps: int) -> tuple[float, dict[str, float]]:
    """(wall ms per step, {op: self-CPU ms per step}) over the next `num_steps` steps."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(num_steps):
            engine.step()
        wall = (time.perf_counter() - t0) / num_steps * 1e3
    ops: dict[str, float] = defaultdict(float)
    for e in prof.key_averages():
        ops[e.key] += e.self_cpu_time_total / 1e3 / num_steps
    return wall, dict(sorted(ops.items(), key=lambda kv: -kv[1]))


def print_table(title: str, wall: float, ops: dict[str, float], rows: int = 12) -> None:
    print(f"\n{title}: {wall:.2f} ms per step (wall, profiler on)")
    print("| op | ms per step | share |\n|---|---|---|")
    accounted = 0.0
    for name, ms in list(ops.items())[:rows]:
        accounted += ms
        print(f"| {name} | {ms:.2f} | {ms / wall:.0%} |")
    print(f"| (other ops) | {sum(ops.values()) - accounted:.2f} | |")
    print(f"| (outside ops: Python, scheduling) | {max(0.0, wall - sum(ops.values())):.2f} | |")


def short_query_steps(engine, ids: list[int], verify: str) -> dict:
    """ms per model forward of one request's q new tokens after ~100 / ~6k cached tokens, through
    the short-query kernel path and through the prefill (SDPA) path. Uses the runner's cache
    blocks 0.. directly (no request is running; run last: it overwrites prefix-cached blocks)."""
    runner = engine.executor
    model, kv, block = runner.model, runner.kv_cache, engine.config.cache.block_size
    kernels = model.layers[0].self_attn.kernels
    if kernels is not None:
        kernels.threads.count = torch.get_num_threads()  # as the tuner does for a quiet machine
    table = list(range(-(-len(ids) // block) + 1))
    out = {}
    with torch.inference_mode():
        meta = attention.build_attention_metadata([len(ids)], [len(ids)], [table], block)
        model(torch.tensor(ids), torch.arange(len(ids)), meta, kv)  # fill the cache
        for ctx in (100, len(ids)):
            for q in (int(x) for x in verify.split(",")):
                row = {}
                for path, limit in (("kernel", attention.SHORT_QUERY_MAX), ("sdpa", 1)):
                    meta = attention.build_attention_metadata([q], [ctx], [table], block,
                                                              short_max=limit)
                    toks, pos = torch.tensor(ids[ctx - q:ctx]), torch.arange(ctx - q, ctx)
                    row[path] = best_of(lambda: model(toks, pos, meta, kv), repeats=5) * 1e3
                out[f"ctx{ctx}_q{q}"] = row
                print(f"short-query step, {q} new tokens after {ctx - q}: kernel "
                      f"{row['kernel']:.2f} ms, SDPA path {row['sdpa']:.2f} ms")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--verify-tokens", default="1,2,5,9,16", help="query lengths of the short-query step")
    args = ap.parse_args()
    machine = roofline()
    print(f"machine: fp32 GEMM {machine['fp32_gemm_gflops']:.0f} GFLOP/s (M=512), "
          f"read {machine['read_gbps']:.1f} GB/s, {machine['threads']} threads")
    llm = LLM("smollm2-135m-instruct", quantization=args.quantization,
              kv_cache_dtype=args.kv_cache_dtype, max_num_batched_tokens=2048)
    eng, tok = llm.engine, llm.tokenizer
    arch = eng.arch
    layer_params = arch.num_layers * arch.hidden_size * (
        (arch.num_heads + 2 * arch.num_kv_heads) * arch.head_dim + arch.num_heads * arch.head_dim
        + 3 * arch.intermediate_size)
    text = " ".join(f"word{i} of the agent's long prompt." for i in range(2000))
    report = {"machine": machine}

    prompt = tok.encode(text)[:2048]
    eng.add_request("prefill", prompt, SamplingParams(max_tokens=1, temperature=0))
    wall, ops = profile_steps(eng, 1)
    while eng.has_unfinished():
        eng.step()
    flops = 2 * layer_params * len(prompt)
    print_table(f"prefill chunk of {len(prompt)} tokens", wall, ops)
    print(f"linear layers: {flops / 1e9:.0f} GFLOP -> {flops / wall / 1e6:.0f} GFLOP/s over the "
          f"whole step = {flops / wall / 1e6 / machine['fp32_gemm_gflops']:.0%} of the GEMM peak")
    report["prefill"] = {"tokens": len(prompt), "ms": wall, "ops": ops}

    for name, ctx in (("decode, ~100 tokens of context", 100),
                      ("decode, ~6,000 tokens of context", 6000)):
        ids = tok.encode(text * 2)[:ctx]
        eng.add_request(name, ids, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
        for _ in range(8):  # the prefill chunks and a few warm decode steps
            eng.step()
        wall, ops = profile_steps(eng, 20)
        while eng.has_unfinished():
            eng.step()
        print_table(name, wall, ops)
        report[name] = {"ms": wall, "ops": ops}
    report["short_query"] = short_query_steps(eng, tok.encode(text * 2)[:6000], args.verify_tokens)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "step_profile.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

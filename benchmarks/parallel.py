"""Tensor/pipeline parallelism on this machine: where a step's time goes, and pipeline bubbles.

    .venv/bin/python benchmarks/parallel.py [--model random|real|moe] [--quick]

For each layout (T x P, M micro-batches) it runs a prefill phase (8 prompts of 128 tokens, one
step) and a decode phase (8 requests, 24 decode steps) and prints, per step: wall time at the
driver, compute (model + sampling, collectives excluded, mean over ranks), TP communication
(all-reduce + all-gather), PP communication (time blocked in stage-to-stage send/recv and
result gathering; this includes waiting for the previous stage), and the pipeline bubble:

    bubble = 1 - mean over ranks of (compute + TP comm) / driver wall time per step

i.e. the share of each rank's step spent waiting for its neighbours; the ideal for P equal
stages and M micro-batches is (P - 1) / (M + P - 1). Model "random" has a shape where T=2 is
valid (SmolLM2's 9 heads are not); "real" is SmolLM2-135M with T=3; "moe" is a random
Qwen3-MoE (32 experts, top 4) measured with T=2 (experts cut along their width) and EP=2
(--enable-expert-parallel: 16 whole experts per rank). On a 2-core CPU with gloo this shows
overheads, not speedups: every rank gets cores / ranks threads.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
RANDOM_SHAPE = dict(num_layers=16, hidden_size=512, num_heads=8, num_kv_heads=4,
                    intermediate_size=1536, vocab_size=16384)
MOE_SHAPE = dict(RANDOM_SHAPE, num_experts=32, num_experts_per_tok=4, expert_intermediate_size=256)


def layouts(model: str, quick: bool) -> list[tuple[int, int, int]]:
    """(T, P, M) to measure; T x P > 1 ranks get cores / ranks threads each."""
    tp = 3 if model == "real" else 2
    if model == "moe":  # T=2 cuts the experts along I; "ep" splits them whole (-tp 2 --enable-ep)
        return [(2, 1, 1), ("ep", 1, 1), ("ep", 2, 2)]
    full = [(tp, 1, 1), (1, 2, 1), (1, 2, 2), (1, 2, 4), (tp, 2, 2)]
    return full[:4] if quick else full


def run_phase(llm, prompts: list[list[int]], max_tokens: int) -> tuple[int, float]:
    """(steps, wall seconds) of running these requests to the end."""
    from hearth.engine.sampling_params import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"b{time.monotonic_ns()}-{i}", prompt, params)
    steps, t0 = 0, time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        steps += 1
    return steps, time.perf_counter() - t0


def summarize(stats, steps: int, wall: float) -> dict:
    if stats is None:  # single process: all compute
        return dict(step_ms=1e3 * wall / steps, compute_ms=1e3 * wall / steps, tp_ms=0.0,
                    pp_ms=0.0, bubble=0.0)
    n = len(stats)
    compute = sum(s.compute_s for s in stats) / n
    tp = sum(s.comm_s.get("tp_all_reduce", 0) + s.comm_s.get("tp_all_gather", 0)
             for s in stats) / n
    pp = sum(s.comm_s.get(k, 0) for s in stats for k in ("pp_recv", "pp_send", "results")) / n
    step = wall / steps
    return dict(step_ms=1e3 * step, compute_ms=1e3 * compute / steps, tp_ms=1e3 * tp / steps,
                pp_ms=1e3 * pp / steps, bubble=max(0.0, 1 - (compute + tp) / steps / step))


def measure(model: str, tp: int, pp: int, m: int, vocab: int, threads: int = 0) -> dict:
    import torch

    from hearth.engine.llm import LLM

    if threads:
        torch.set_num_threads(threads)
    expert_parallel = tp == "ep"
    tp = 2 if expert_parallel else tp
    llm = LLM(model, tensor_parallel_size=tp, pipeline_parallel_size=pp, num_micro_batches=m,
              num_blocks=256, enable_prefix_caching=False, enable_expert_parallel=expert_parallel)
    runner = llm.engine.executor
    threads = torch.get_num_threads()  # per rank: the executor divides the cores
    collect = getattr(runner, "collect_stats", None)
    try:
        prompts = [[(97 * i + 13 * j) % (vocab - 10) + 5 for j in range(128)] for i in range(8)]
        run_phase(llm, prompts[:2], 2)  # warm-up
        collect and collect()
        steps, wall = run_phase(llm, prompts, 1)
        prefill = summarize(collect() if collect else None, steps, wall)
        run_phase(llm, [p[:16] for p in prompts], 25)  # warm-up of the decode shapes
        collect and collect()
        t_steps, t_wall = run_phase(llm, [p[:16] for p in prompts], 25)
        decode = summarize(collect() if collect else None, t_steps, t_wall)
    finally:
        llm.engine.close()
    return dict(tp=tp, pp=pp, m=m, ep=expert_parallel, threads=threads, prefill=prefill,
                decode=decode)


def print_table(rows: list[dict]) -> None:
    print(f"{'T':>4} {'P':>2} {'M':>2} {'thr':>3}  {'phase':<8}{'step ms':>9}{'compute':>9}"
          f"{'TP comm':>9}{'PP comm':>9}{'bubble':>8}{'ideal':>7}")
    for r in rows:
        ideal = (r["pp"] - 1) / (r["m"] + r["pp"] - 1)
        for phase in ("prefill", "decode"):
            s = r[phase]
            layout = f"EP{r['tp']}" if r.get("ep") else str(r["tp"])
            print(f"{layout:>4} {r['pp']:>2} {r['m']:>2} {r['threads']:>3}  {phase:<8}"
                  f"{s['step_ms']:>9.1f}{s['compute_ms']:>9.1f}{s['tp_ms']:>9.1f}{s['pp_ms']:>9.1f}"
                  f"{100 * s['bubble']:>7.0f}%{100 * ideal:>6.0f}%")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["random", "real", "moe"], default="random")
    parser.add_argument("--quick", action="store_true", help="skip the T x P layout")
    a = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if a.model == "real":
            model, vocab = "smollm2-135m-instruct", 49152
        else:
            from hearth.models.random_checkpoint import write_random_checkpoint

            shape = MOE_SHAPE if a.model == "moe" else RANDOM_SHAPE
            model = str(write_random_checkpoint(Path(tmp) / a.model, **shape))
            vocab = shape["vocab_size"]
        cores = os.cpu_count() or 1
        # One process: with 1 thread (one core) and with every core (what T x P ranks share).
        rows = [measure(model, 1, 1, 1, vocab, threads) for threads in sorted({1, cores})]
        for tp, pp, m in layouts(a.model, a.quick):
            rows.append(measure(model, tp, pp, m, vocab))
            print(f"measured T={tp} P={pp} M={m}", flush=True)
    print_table(rows)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"parallel_{a.model}.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

"""MLA (DeepSeek-V3 / Kimi K2 shape, scaled down): KV bytes per token, prefill, and the decode
step at growing context against its memory roofline, in hearth, in one process.

    .venv/bin/python benchmarks/mla_bench.py [--model-dir /tmp/mla-bench] [--contexts 100 4096 16384]
        [--repeats 2] [--json benchmarks/results/mla.json]

Builds (once) a random-weight DeepseekV3ForCausalLM of the shape below with
`write_random_deepseek` (bf16 safetensors, a word-level tokenizer), serves it with hearth's
default formats (Q8_0 projections and experts for decode steps, bf16 KV cache where the CPU has
AVX512-BF16), and reports:

  * KV bytes per token: the latent row (kv_lora_rank + qk_rope_head_dim per layer) against the
    same model with expanded K/V (every head's K of qk_head_dim and V of v_head_dim), and
    against a GQA model of the same hidden size (16 heads / 4 KV heads of 64);
  * prefill of a 2k-token prompt (tokens/s);
  * the single-stream decode step at each context: measured ms, the bytes it must read
    (active weights in their decode format + the context's latent rows), the step time those
    bytes take at the machine's measured read bandwidth (the memory roofline) and the ratio, and
    the time the absorbed attention's FLOPs take at the machine's fp32 GEMM rate (with 16 heads
    sharing one latent row, 2 x 16 multiply-adds per value read: long contexts are bound by
    compute on a 2-core CPU, not by memory).

Each figure is repeated (--repeats) and reported min / median. Random weights are fine for
speed; the shape is what counts:

    12 layers (2 dense first), hidden 1024, 16 heads, q_lora 384, MLA kv_lora 256 + rope 64,
    qk_nope 64, v 64, 64 routed experts of width 256, top 6 in 8 groups (best 4), 1 shared
    expert, dense width 2816, vocab 49,152
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
from hearth.engine.llm import LLM  # noqa: E402
from hearth.engine.sampling_params import SamplingParams  # noqa: E402
from hearth.models.random_checkpoint import write_random_deepseek  # noqa: E402

SHAPE = dict(num_layers=12, hidden_size=1024, num_heads=16, q_lora_rank=384, kv_lora_rank=256,
             qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64, intermediate_size=2816,
             num_experts=64, num_experts_per_tok=6, expert_intermediate_size=256, n_group=8,
             topk_group=4, n_shared_experts=1, first_k_dense_replace=2, vocab_size=49152,
             max_position_embeddings=32768)
Q8 = 34 / 32  # bytes per weight of Q8_0


def decode_weight_bytes(s: dict) -> int:
    """Bytes one batch-1 decode step reads of weights: attention projections and the absorbed
    up-projections (W_UK^T and W_UV, cut from kv_b_proj), dense / shared / top-k experts in
    Q8_0, fp32 routers, the LM head."""
    h, heads = s["hidden_size"], s["num_heads"]
    qk = s["qk_nope_head_dim"] + s["qk_rope_head_dim"]
    latent = s["kv_lora_rank"] + s["qk_rope_head_dim"]
    attn_q8 = h * (s["q_lora_rank"] + latent) + s["q_lora_rank"] * heads * qk + heads * s["v_head_dim"] * h
    kv_b = Q8 * s["kv_lora_rank"] * heads * (s["qk_nope_head_dim"] + s["v_head_dim"])
    dense = 3 * h * s["intermediate_size"]
    expert = 3 * h * s["expert_intermediate_size"]
    sparse = (s["num_experts_per_tok"] + s["n_shared_experts"]) * expert
    layers, first = s["num_layers"], s["first_k_dense_replace"]
    total = layers * (Q8 * attn_q8 + kv_b) + Q8 * (first * dense + (layers - first) * sparse)
    total += 4 * (layers - first) * s["num_experts"] * h  # routers
    return int(total + Q8 * s["vocab_size"] * h)


def kv_bytes_per_token(s: dict, itemsize: int) -> dict:
    heads = s["num_heads"]
    qk = s["qk_nope_head_dim"] + s["qk_rope_head_dim"]
    latent = s["num_layers"] * (s["kv_lora_rank"] + s["qk_rope_head_dim"]) * itemsize
    expanded = s["num_layers"] * heads * (qk + s["v_head_dim"]) * itemsize
    gqa = s["num_layers"] * 2 * 4 * 64 * itemsize  # 4 KV heads of 64
    return {"latent": latent, "expanded": expanded, "gqa_4x64": gqa}


def read_bandwidth() -> float:
    """GB/s of a streaming read (sum over 1 GiB of fp32, best of 5) with torch's threads."""
    x = torch.ones(2**28)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


def gemm_rate() -> float:
    """GFLOP/s of an fp32 GEMM (1024^3, best of 5) with torch's threads: the compute ceiling."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * 1024 ** 3 / best / 1e9


def attention_flops(s: dict, ctx: int) -> int:
    """FLOPs of one token's absorbed latent attention over `ctx` tokens, all layers: every
    head's scores over the whole row and its weighted sum of the row (the kernel's V is the
    row), 2 FLOPs per multiply-add."""
    row = s["kv_lora_rank"] + s["qk_rope_head_dim"]
    return s["num_layers"] * 2 * 2 * s["num_heads"] * row * ctx


def timed_steps(llm: LLM, prompt: list[int], decode_tokens: int) -> tuple[float, list[float]]:
    """(prefill seconds, each later step's seconds) of one request run alone."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=decode_tokens + 1, ignore_eos=True)
    engine.add_request(f"bench-{time.monotonic_ns()}", prompt, params)
    t0 = time.perf_counter()
    prefill, steps, produced = None, [], 0
    while engine.has_unfinished():
        t = time.perf_counter()
        outs = engine.step()
        now = time.perf_counter()
        produced += sum(len(o.new_token_ids) for o in outs)
        if prefill is None:
            if produced:
                prefill = now - t0
        else:
            steps.append(now - t)
    return prefill, steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", type=Path, default=Path("/tmp/mla-bench"))
    ap.add_argument("--contexts", type=int, nargs="+", default=[100, 4096, 16384])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--decode-tokens", type=int, default=24)
    ap.add_argument("--quantization", default="q8_0",
                    help="decode weight format (q8_0: float32 activations; q8_0-a8: 8-bit)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--png", type=Path, help="plot the decode step against its rooflines")
    ap.add_argument("--from-json", type=Path, help="only plot/print a saved run")
    args = ap.parse_args()
    if args.from_json:
        plot(json.loads(args.from_json.read_text()), args.png)
        return
    if not (args.model_dir / "model.safetensors").exists():
        write_random_deepseek(args.model_dir, **SHAPE, dtype=torch.bfloat16)
    bandwidth, flops = read_bandwidth(), gemm_rate()
    llm = LLM(str(args.model_dir), max_model_len=max(args.contexts + [2048]) + 64,
              enable_prefix_caching=False, quantization=args.quantization,
              kv_cache_dtype="auto")
    kv_dtype = llm.engine.executor.kv_cache.dtype
    kv = kv_bytes_per_token(SHAPE, kv_dtype.itemsize)
    weights = decode_weight_bytes(SHAPE)
    gen = torch.Generator().manual_seed(0)

    def prompt(n: int) -> list[int]:
        return torch.randint(3, SHAPE["vocab_size"], (n,), generator=gen).tolist()

    results = {"shape": SHAPE, "quantization": args.quantization, "kv_dtype": str(kv_dtype), "read_bandwidth_gbs": bandwidth,
               "gemm_gflops": flops,
               "kv_bytes_per_token": kv, "decode_weight_bytes": weights, "contexts": {}}
    prefills = [2048 / timed_steps(llm, prompt(2048), 0)[0] for _ in range(args.repeats)]
    results["prefill_2k_tok_s"] = prefills
    for ctx in args.contexts:
        runs = []
        for _ in range(args.repeats):
            _, steps = timed_steps(llm, prompt(ctx), args.decode_tokens)
            runs.append(statistics.median(steps[2:]) * 1000)  # first steps warm the threads
        read = weights + ctx * kv["latent"]
        memory_ms = read / (bandwidth * 1e9) * 1000
        compute_ms = attention_flops(SHAPE, ctx) / (flops * 1e9) * 1000
        results["contexts"][ctx] = {"step_ms": runs, "bytes_read": read,
                                    "kv_bytes": ctx * kv["latent"], "memory_roofline_ms": memory_ms,
                                    "attention_compute_ms": compute_ms}
    assert llm.engine.kv_pool_is_whole()
    llm.engine.close()

    print(f"KV dtype {kv_dtype}; read bandwidth {bandwidth:.1f} GB/s; fp32 GEMM {flops:.0f} "
          f"GFLOP/s; decode weights {weights / 1e6:.0f} MB")
    print(f"KV bytes/token: latent {kv['latent']:,}  expanded K/V {kv['expanded']:,} "
          f"({kv['expanded'] / kv['latent']:.1f}x)  GQA 4x64 {kv['gqa_4x64']:,} "
          f"({kv['gqa_4x64'] / kv['latent']:.1f}x)")
    print(f"prefill 2k: min {min(prefills):.0f} / median {statistics.median(prefills):.0f} tok/s")
    print(f"{'context':>8} {'step ms min/med':>16} {'read MB':>8} {'KV MB':>7} {'memory ms':>10} "
          f"{'x memory':>9} {'attn compute ms':>16}")
    for ctx, r in results["contexts"].items():
        best, med = min(r["step_ms"]), statistics.median(r["step_ms"])
        print(f"{ctx:>8} {best:>7.1f} / {med:<7.1f} {r['bytes_read'] / 1e6:>8.0f} "
              f"{r['kv_bytes'] / 1e6:>7.1f} {r['memory_roofline_ms']:>10.1f} "
              f"{best / r['memory_roofline_ms']:>9.2f} {r['attention_compute_ms']:>16.1f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    if args.png:
        plot(json.loads(json.dumps(results)), args.png)


def plot(results: dict, png: Path | None) -> None:
    """Measured decode step (min) per context beside the memory roofline and the attention's
    compute time at the GEMM rate."""
    if png is None:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ctxs = list(results["contexts"])
    rows = [results["contexts"][c] for c in ctxs]
    x = range(len(ctxs))
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar([i - 0.27 for i in x], [min(r["step_ms"]) for r in rows], 0.27, label="measured step")
    ax.bar(list(x), [r["memory_roofline_ms"] for r in rows], 0.27,
           label="memory roofline (weights + latent KV)")
    ax.bar([i + 0.27 for i in x], [r["attention_compute_ms"] for r in rows], 0.27,
           label="attention FLOPs at fp32 GEMM rate")
    ax.set_xticks(list(x), [f"{c} ctx" for c in ctxs])
    ax.set_ylabel("ms per decode step (batch 1)")
    ax.set_title("DeepSeek-V3-shaped MLA model (random, 12 layers), hearth, 2-core CPU")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)


if __name__ == "__main__":
    main()

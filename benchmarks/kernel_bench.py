"""Micro-benchmarks of hearth's CPU kernels (issue 11), outside the engine.

    .venv/bin/python benchmarks/kernel_bench.py [--variant auto]

* qlinear: the linear layers of one SmolLM2-135M step (30 layers of Q4_1 QKV / O / gate-up /
  down, every one a distinct weight so the 96 MB stream is not cache-hot, plus the Q8_0 LM
  head), for M = 1..16 rows, with fp32 activations (exact) and 8-bit activations (int8_act).
* short-query attention: one layer (9 query / 3 KV heads, head dim 64, fp32 cache, block 16,
  scattered block table) with q = 1..16 new tokens at 100..6,000 tokens of context: the kernel
  (`decode_attention` with query_lens) against gathering the blocks + torch's flash SDPA (the
  path such a request took before the short-query kernel).
* prefill attention: one layer, a 2k-token prompt fresh and after a 40-token cached head, and a
  500-token chunk after 4,000 cached tokens (an agent turn): `prefill_attention` over the cache
  in place against the torch path it replaced (gather + torch's CPU flash kernel: one causal call,
  or two merged by log-sum-exp after a prefix). GFLOP/s counts only the visible (causal) pairs.
Prints best-of-N milliseconds; writes benchmarks/results/kernel_bench.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from hearth.models.quant import quantize_q8_0  # noqa: E402
from hearth.ops.attention_backends.torch_sdpa import prefix_chunk_attention  # noqa: E402
from hearth.ops.cpu_kernels import QTYPE_IDS, load_cpu_kernels, pack_ggml  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def best_ms(fn, repeats: int = 7) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def q4_1_blocks(n: int, k: int, gen) -> torch.Tensor:
    nb = k // 32
    d = (torch.rand(n, nb, 1, generator=gen) * 0.1 + 0.01).half().view(torch.uint8)
    m = (torch.randn(n, nb, 1, generator=gen) * 0.05).half().view(torch.uint8)
    qs = torch.randint(0, 256, (n, nb, 16), generator=gen, dtype=torch.uint8)
    return torch.cat([d.reshape(n, nb, 2), m.reshape(n, nb, 2), qs], -1).reshape(n, -1)


def bench_qlinear(kernels) -> dict:
    gen = torch.Generator().manual_seed(0)
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30
    blocks = [(k, 3, q4_1_blocks(n, k, gen)) for n, k in shapes]
    blocks.append((576, 8, quantize_q8_0(torch.randn(49152, 576, generator=gen))))
    out = {}
    for int8_act in (False, True):
        weights = [(k, pack_ggml(qtype, b, int8_act=int8_act)) for k, qtype, b in blocks]
        for rows in (1, 2, 4, 8, 16):
            xs = {k: torch.randn(rows, k) for k in (576, 1536)}
            ms = best_ms(lambda: [kernels.qlinear(xs[k], w) for k, w in weights], repeats=5)
            out[f"{'int8' if int8_act else 'fp32'}_act_M{rows}"] = ms
            print(f"qlinear, one step's linears, M={rows}, "
                  f"{'int8' if int8_act else 'fp32'} activations: {ms:.2f} ms")
    return out


def bench_attention(kernels) -> dict:
    heads, kv_heads, dim, block = 9, 3, 64, 16
    out = {}
    for ctx in (100, 1000, 3000, 6000):
        nb = -(-ctx // block)
        kc = torch.randn(nb + 4, block, kv_heads, dim)
        vc = torch.randn_like(kc)
        table = torch.randperm(nb + 4)[:nb]
        t32 = table.to(torch.int32)[None]
        for q in (1, 2, 5, 16):
            qq = torch.randn(q, heads, dim)
            ctx_t, q_t = torch.tensor([ctx], dtype=torch.int32), torch.tensor([q], dtype=torch.int32)

            def kernel():
                return kernels.ops.decode_attention(qq, kc, vc, t32, ctx_t, 0.125, kernels.decode_split,
                                                    torch.get_num_threads(), q_t)

            def sdpa():
                ki = kc[table].view(-1, kv_heads, dim)[:ctx]
                vi = vc[table].view(-1, kv_heads, dim)[:ctx]
                mask = torch.arange(ctx)[None, :] <= torch.arange(q)[:, None] + (ctx - q)
                return F.scaled_dot_product_attention(
                    qq.transpose(0, 1)[None], ki.transpose(0, 1)[None], vi.transpose(0, 1)[None],
                    attn_mask=mask, scale=0.125, enable_gqa=True)

            row = {"kernel": best_ms(kernel), "gather_sdpa": best_ms(sdpa)}
            out[f"ctx{ctx}_q{q}"] = row
            print(f"attention, one layer, ctx {ctx}, q {q}: kernel {row['kernel']:.3f} ms, "
                  f"gather + SDPA {row['gather_sdpa']:.3f} ms")
    return out


def bench_prefill_attention(kernels) -> dict:
    heads, kv_heads, dim, block = 9, 3, 64, 16
    out = {}
    for prefix, q_len in ((0, 2048), (40, 2010), (4000, 500)):
        ctx = prefix + q_len
        nb = -(-ctx // block)
        kc = torch.randn(nb + 4, block, kv_heads, dim)
        vc = torch.randn_like(kc)
        table = torch.randperm(nb + 4)[:nb]
        t32 = table.to(torch.int32)
        qq = torch.randn(q_len, heads, dim)

        def kernel():
            return kernels.ops.prefill_attention(qq, kc, vc, t32, ctx, 0.125, torch.get_num_threads())

        def torch_path():
            ki = kc[table].view(-1, kv_heads, dim)[:ctx].transpose(0, 1)
            vi = vc[table].view(-1, kv_heads, dim)[:ctx].transpose(0, 1)
            qi = qq.transpose(0, 1)
            if prefix:
                return prefix_chunk_attention(qi, ki, vi, prefix, 0.125)
            return F.scaled_dot_product_attention(qi[None], ki[None], vi[None], is_causal=True,
                                                  scale=0.125, enable_gqa=True)

        flops = 4 * dim * heads * sum(prefix + i + 1 for i in range(q_len))
        row = {"kernel": best_ms(kernel), "torch_flash": best_ms(torch_path)}
        row["kernel_gflops"] = flops / row["kernel"] / 1e6
        row["torch_flash_gflops"] = flops / row["torch_flash"] / 1e6
        out[f"prefix{prefix}_q{q_len}"] = row
        print(f"prefill attention, one layer, {q_len} queries after {prefix} cached: kernel "
              f"{row['kernel']:.1f} ms ({row['kernel_gflops']:.0f} GFLOP/s), torch flash "
              f"{row['torch_flash']:.1f} ms ({row['torch_flash_gflops']:.0f} GFLOP/s)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", default="auto", help="kernel build (auto: the best usable)")
    args = ap.parse_args()
    kernels = load_cpu_kernels(args.variant)
    if kernels is None:
        sys.exit("no CPU kernel build is usable here: run `make setup`")
    kernels.threads.count = torch.get_num_threads()
    print(f"kernels {kernels.variant}, {torch.get_num_threads()} threads")
    report = {"variant": kernels.variant, "qlinear": bench_qlinear(kernels),
              "attention": bench_attention(kernels),
              "prefill_attention": bench_prefill_attention(kernels)}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "kernel_bench.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

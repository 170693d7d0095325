"""Prompt-chunk attention over a paged cache: hearth's `prefill_attention` kernel against the
torch backend's path (the cached prefix gathered out of the cache, then torch's CPU flash
kernel twice, merged by log-sum-exp: `TorchAttentionBackend.prompt_chunk`).

    .venv/bin/python benchmarks/prefill_attention.py [--threads 1 2] [--heads 9 3 64]

Random float32 cache with a shuffled block table, the chunk's queries at the end of its context
(a later agent turn: new tokens after a cached prefix). Prints, per (chunk, context) and thread
count, the best of --repeats calls of each path, GFLOP/s (4 * H * D per visible query-key pair)
and the largest difference between the two outputs.
"""

from __future__ import annotations

import argparse
import time

import torch

from hearth.ops.attention_backends.torch_sdpa import TorchAttentionBackend
from hearth.ops.cpu_kernels import load_cpu_kernels

SHAPES = ((512, 4096), (512, 8192), (2048, 8192), (128, 16384))  # (new tokens, context)


def best_of(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--heads", type=int, nargs=3, default=[9, 3, 64], metavar=("H", "KVH", "D"),
                   help="query heads, KV heads, head dim (default: SmolLM2-135M's)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    kernels = load_cpu_kernels("auto")
    if kernels is None:
        raise SystemExit("no CPU kernel build is usable: run make setup")
    heads, kv_heads, dim = args.heads
    bs, scale = args.block_size, dim ** -0.5
    torch_path = TorchAttentionBackend()
    gen = torch.Generator().manual_seed(0)
    print(f"kernel build {kernels.variant}; heads {heads} x {dim}, {kv_heads} KV heads; "
          f"vector path: {kernels.fast_prefill_attention(heads, kv_heads, dim)}")
    print("| threads | new tokens | context | torch ms (GFLOP/s) | kernel ms (GFLOP/s) | "
          "torch / kernel | max diff |")
    print("|---|---|---|---|---|---|---|")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for q_len, ctx in SHAPES:
            blocks = -(-ctx // bs)
            kc = torch.randn(blocks + 1, bs, kv_heads, dim, generator=gen)
            vc = torch.randn(blocks + 1, bs, kv_heads, dim, generator=gen)
            table = torch.randperm(blocks + 1, generator=gen)[:blocks].to(torch.int32)
            q = torch.randn(q_len, heads, dim, generator=gen)
            own = torch.empty(q_len, kv_heads, dim)  # unused: the chunk's K/V are in the cache
            flops = 4 * heads * dim * (q_len * (ctx - q_len) + q_len * (q_len + 1) / 2)
            ref = lambda: torch_path.prompt_chunk(q, own, own, kc, vc, table.long(), ctx, scale)  # noqa: E731
            got = lambda: kernels.ops.prefill_attention(q, kc, vc, table, ctx, scale, threads)  # noqa: E731
            t_ref, t_got = best_of(ref, args.repeats), best_of(got, args.repeats)
            diff = (ref() - got()).abs().max().item()
            print(f"| {threads} | {q_len} | {ctx} | {t_ref * 1e3:.1f} ({flops / t_ref / 1e9:.0f}) | "
                  f"{t_got * 1e3:.1f} ({flops / t_got / 1e9:.0f}) | {t_ref / t_got:.2f}x | {diff:.1e} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

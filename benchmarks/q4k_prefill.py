"""Prompt-step kernels on one blocks-only Q4_K (or `--fmt q6_k`) weight (issue 42): thread CPU time per call, one
thread, of qlinear with 8-bit activations (`--quantization gguf-a8`'s path up to the row line of
hearth/models/layers.py) against the float path above it (a tile of rows decoded by
`dequant_rows`, then torch.mm in fp32), at M = 1..512 rows.

    .venv/bin/python benchmarks/q4k_prefill.py [OLD.so ...] [--rows 1 4 32 128 512]
        [--fmt q4_k|q6_k] [--shape 14336 4096] [--repeats 10]

`--moe`: the MoE expert op (`moe_experts` with 8-bit activations, csrc/moe.h) on one
Qwen3-30B-A3B-shaped layer instead: 128 experts top-8, hidden 2048, expert width 768, Q4_K
gate/up and `--fmt` down, at `--tokens` tokens per step (router: softmax of random logits);
GOPS = 2 T k (2I H + H I) / time.

    .venv/bin/python benchmarks/q4k_prefill.py --moe [OLD.so ...] [--tokens 64 256 512]

Thread CPU time (time.thread_time), min over the repeats, so a shared machine's other load
counts little (wall time there is meaningless). Each build (this checkout's, and each .so given,
e.g. a copy of hearth/ops/_build's library from before a change) runs in its own process.
GOPS = 2 M N K / time.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def q4_k_blocks(n: int, k: int, gen):
    """Random ggml Q4_K super-blocks [n, k / 256 * 144] uint8 with sane fp16 d and dmin."""
    import torch

    ns = k // 256
    d = (torch.rand(n, ns, 2, generator=gen) * 0.01 + 0.001).half()
    rest = torch.randint(0, 256, (n, ns, 140), generator=gen, dtype=torch.uint8)
    return torch.cat([d.view(torch.uint8).reshape(n, ns, 4), rest], -1).reshape(n, -1).contiguous()


def q6_k_blocks(n: int, k: int, gen):
    """Random ggml Q6_K super-blocks [n, k / 256 * 210] uint8 (ql | qh | int8 scales | d)."""
    import torch

    ns = k // 256
    body = torch.randint(0, 256, (n, ns, 208), generator=gen, dtype=torch.uint8)
    d = (torch.rand(n, ns, 1, generator=gen) * 0.01 + 0.001).half()
    return torch.cat([body, d.view(torch.uint8).reshape(n, ns, 2)], -1).reshape(n, -1).contiguous()


def measure(so: str | None, fmt: str, rows: list[int], n: int, k: int, repeats: int) -> dict:
    import torch

    torch.set_num_threads(1)
    if so:
        torch.ops.load_library(so)
    from hearth.models.layers import TILE_BYTES
    from hearth.ops.cpu_kernels import QTYPE_IDS, load_cpu_kernels, pack_ggml

    kernels = load_cpu_kernels()
    gen = torch.Generator().manual_seed(0)
    make = q4_k_blocks if fmt == "q4_k" else q6_k_blocks
    w = pack_ggml(QTYPE_IDS[fmt], make(n, k, gen), int8_act=True)
    tile = max(64, TILE_BYTES // (k * 4)) // 64 * 64

    def a8(x):
        return torch.ops.hearth.qlinear(x, w.qs, w.d, w.m, w.qtype, n, k, 1, True)

    def dequant_mm(x):  # layers.QuantizedWeight._tiled_matmul in fp32
        out = torch.empty(x.shape[0], n)
        for n0 in range(0, n, tile):
            n1 = min(n0 + tile, n)
            part = kernels.dequant_rows(w, torch.arange(n0, n1))
            torch.mm(x, part.t(), out=out[:, n0:n1])
        return out

    result = {}
    for m in rows:
        x = torch.randn(m, k, generator=gen)
        for name, fn in (("a8", a8), ("float", dequant_mm)):
            fn(x)
            best = float("inf")
            for _ in range(repeats if m <= 32 else max(2, repeats // 3)):
                t0 = time.thread_time()
                fn(x)
                best = min(best, time.thread_time() - t0)
            result[f"{name}/{m}"] = best
    return result


MOE_SHAPE = dict(experts=128, top_k=8, hidden=2048, inter=768)


def measure_moe(so: str | None, fmt: str, tokens: list[int], repeats: int) -> dict:
    """Thread CPU seconds of one layer's moe_experts (8-bit activations, 1 thread) per step."""
    import torch

    torch.set_num_threads(1)
    if so:
        torch.ops.load_library(so)
    from hearth.models.moe import route_softmax
    from hearth.ops.cpu_kernels import QTYPE_IDS, load_cpu_kernels, pack_ggml

    load_cpu_kernels()
    e, k, h, inter = (MOE_SHAPE[n] for n in ("experts", "top_k", "hidden", "inter"))
    gen = torch.Generator().manual_seed(0)
    q13 = pack_ggml(QTYPE_IDS["q4_k"], q4_k_blocks(e * 2 * inter, h, gen), int8_act=True)
    make = q4_k_blocks if fmt == "q4_k" else q6_k_blocks
    q2 = pack_ggml(QTYPE_IDS[fmt], make(e * h, inter, gen), int8_act=True)
    one = torch.zeros(1, 1, 1)  # stand-ins of the float stacks' shapes (the packed path)
    w13, w2 = one.expand(e, 2 * inter, h), one.expand(e, h, inter)
    q = [q13.qs, q13.d, q13.m, q2.qs, q2.d, q2.m]
    result = {}
    for t in tokens:
        x = torch.randn(t, h, generator=gen)
        weights, ids = route_softmax(torch.randn(t, e, generator=gen), k, True)

        def step():
            return torch.ops.hearth.moe_experts(x, w13, w2, weights, ids, 0, q,
                                                [q13.qtype, q2.qtype], 1, True, None, None, 0,
                                                1.702, 7.0)

        step()
        best = float("inf")
        for _ in range(repeats):
            t0 = time.thread_time()
            step()
            best = min(best, time.thread_time() - t0)
        result[f"moe/{t}"] = best
    return result


def main_moe(args) -> None:
    e, k, h, inter = (MOE_SHAPE[n] for n in ("experts", "top_k", "hidden", "inter"))
    table = {}
    for so in ["", *args.builds]:
        cmd = [sys.executable, __file__, "--moe", "--child", so, "--tokens",
               *map(str, args.tokens), "--fmt", args.fmt, "--repeats", str(args.repeats)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"{so or 'this checkout'}: {proc.stderr[-3000:]}")
        table[so or "this checkout"] = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"moe_experts, {e} experts top-{k}, H {h}, I {inter}, Q4_K gate/up, "
          f"{args.fmt.upper()} down, 8-bit activations, 1 thread: thread CPU ms per step (GOPS)")
    print(f"{'T':>5} " + " ".join(f"{b[-30:]:>30}" for b in table))
    for t in args.tokens:
        flops = 2 * t * k * (2 * inter * h + h * inter)
        times = [table[b][f"moe/{t}"] for b in table]
        cells = [f"{s * 1e3:>10.1f} ms ({flops / s / 1e9:6.1f})" for s in times]
        print(f"{t:>5} " + " ".join(f"{c:>30}" for c in cells))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("builds", nargs="*", help="other kernel builds (.so) to measure alongside")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 32, 128, 512])
    ap.add_argument("--fmt", choices=["q4_k", "q6_k"], default="q4_k")
    ap.add_argument("--shape", type=int, nargs=2, default=[14336, 4096])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--moe", action="store_true", help="the MoE expert op (Qwen3-30B-A3B layer)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 256, 512])
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.moe and args.child is not None:
        print(json.dumps(measure_moe(args.child or None, args.fmt, args.tokens, args.repeats)))
        return
    if args.moe:
        return main_moe(args)
    n, k = args.shape
    if args.child is not None:
        print(json.dumps(measure(args.child or None, args.fmt, args.rows, n, k, args.repeats)))
        return
    table = {}
    for so in ["", *args.builds]:
        cmd = [sys.executable, __file__, "--child", so, "--rows", *map(str, args.rows),
               "--fmt", args.fmt, "--shape", str(n), str(k), "--repeats", str(args.repeats)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"{so or 'this checkout'}: {proc.stderr[-3000:]}")
        out = proc.stdout
        table[so or "this checkout"] = json.loads(out.strip().splitlines()[-1])
    print(f"{args.fmt.upper()} [{n}, {k}], 1 thread, thread CPU ms per call (GOPS/thread)")
    cols = [(b, p) for b in table for p in ("a8", "float")]
    print(f"{'M':>5} " + " ".join(f"{(b[-24:] + ' ' + p):>34}" for b, p in cols))
    for m in args.rows:
        cells = []
        for b, p in cols:
            t = table[b][f"{p}/{m}"]
            cells.append(f"{t * 1e3:>10.2f} ms ({2 * m * n * k / t / 1e9:6.1f})")
        print(f"{m:>5} " + " ".join(f"{c:>34}" for c in cells))


if __name__ == "__main__":
    main()

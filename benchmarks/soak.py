"""Soak: N requests at concurrency C against `hearth serve` and `hearth up`, with hostile ones mixed
in; errors by kind, latency p50/p99, and the RSS of every process before and after.

    .venv/bin/python benchmarks/soak.py [--requests 300] [--concurrency 8] [--targets serve,up]

The mix, per request (seeded): 60% streamed chat, 20% non-streamed chat, 10% malformed or
over-limit bodies (must be 4xx), 10% streams the client drops after the first chunk. Afterwards
the worker's /load must show nothing running or waiting and every KV block free. Not a test:
timing is reported, never asserted. Writes benchmarks/results/soak.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

RESULTS = Path(__file__).parent / "results"
HEARTH = str(Path(sys.executable).parent / "hearth")
BAD_BODIES = [
    b"{not json",
    json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "seed": 2**70}).encode(),
    json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}).encode(),
    json.dumps({"model": "m", "messages": "nope"}).encode(),
    b"[" * 5000 + b"]" * 5000,
    json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 3_000_000}]}).encode(),
]


def tree_rss(pid: int) -> dict[str, float]:
    """RSS in MB of a process and its descendants, keyed by a short command description."""
    out = {}
    root = psutil.Process(pid)
    for p in [root, *root.children(recursive=True)]:
        try:
            cmd = " ".join(p.cmdline()[1:4])[:60]
            out[f"{p.pid} {cmd}"] = p.memory_info().rss / 2**20
        except psutil.NoSuchProcess:
            pass
    return out


async def one(client: httpx.AsyncClient, url: str, rng: random.Random, i: int) -> tuple[str, float]:
    kind = rng.random()
    body = {"model": "smollm2-135m-instruct", "max_tokens": rng.randint(4, 24),
            "messages": [{"role": "user", "content": f"Request {i}: name {rng.randint(2, 9)} animals."}]}
    t0 = time.perf_counter()
    try:
        if kind < 0.1:
            r = await client.post(url + "/v1/chat/completions", content=rng.choice(BAD_BODIES),
                                  headers={"content-type": "application/json"})
            return (f"bad->{r.status_code}", time.perf_counter() - t0)
        if kind < 0.3:
            r = await client.post(url + "/v1/chat/completions", json=body)
            return (str(r.status_code), time.perf_counter() - t0)
        body["stream"] = True
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            async for _ in r.aiter_lines():
                if kind < 0.4:
                    return ("dropped", time.perf_counter() - t0)  # leave mid-stream
            return (str(r.status_code), time.perf_counter() - t0)
    except httpx.HTTPError as exc:
        return (f"error:{type(exc).__name__}", time.perf_counter() - t0)


async def soak(url: str, requests: int, concurrency: int, seed: int) -> tuple[dict, list[float]]:
    rng = random.Random(seed)
    queue = list(range(requests))
    outcomes: dict[str, int] = {}
    latencies: list[float] = []

    async def worker() -> None:
        async with httpx.AsyncClient(timeout=120) as client:
            while queue:
                kind, seconds = await one(client, url, rng, queue.pop())
                outcomes[kind] = outcomes.get(kind, 0) + 1
                if kind == "200":
                    latencies.append(seconds)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return outcomes, sorted(latencies)


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url}: not healthy after {timeout} s")


def idle_load(url: str) -> dict:
    """Wait (bounded) for the worker to drain the dropped streams, then return its /load."""
    deadline = time.monotonic() + 30
    while True:
        load = httpx.get(url + "/load", timeout=5).json()
        if (load.get("num_running", 0) == 0 and load.get("num_waiting", 0) == 0) or time.monotonic() > deadline:
            return load
        time.sleep(0.2)


def run_target(name: str, port: int, args) -> dict:
    cmd = ([HEARTH, "serve", "--port", str(port)] if name == "serve" else
           [HEARTH, "up", "--prefill", "1", "--decode", "1", "--port", str(port)])
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        asyncio.run(soak(url, 8, 2, seed=1))  # warm up
        before = tree_rss(proc.pid)
        t0 = time.perf_counter()
        outcomes, lat = asyncio.run(soak(url, args.requests, args.concurrency, args.seed))
        wall = time.perf_counter() - t0
        after = tree_rss(proc.pid)
        load = idle_load(url) if name == "serve" else {}
        pct = (lambda q: lat[min(len(lat) - 1, int(q * len(lat)))] if lat else float("nan"))
        return {"target": name, "wall_s": wall, "outcomes": outcomes, "p50_s": pct(0.5),
                "p99_s": pct(0.99), "rss_before_mb": before, "rss_after_mb": after,
                "load_after": load}
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--targets", default="serve,up")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--port", type=int, default=8300)
    args = ap.parse_args()
    reports = [run_target(t, args.port + i, args) for i, t in enumerate(args.targets.split(","))]
    for r in reports:
        print(f"\n## {r['target']}: {args.requests} requests at concurrency {args.concurrency}, "
              f"{r['wall_s']:.1f} s; p50 {r['p50_s']:.2f} s, p99 {r['p99_s']:.2f} s (200s only)")
        print("outcomes:", ", ".join(f"{k}: {v}" for k, v in sorted(r["outcomes"].items())))
        print("| process | RSS before (MB) | after (MB) |\n|---|---|---|")
        for key, mb in r["rss_before_mb"].items():
            print(f"| {key} | {mb:.0f} | {r['rss_after_mb'].get(key, float('nan')):.0f} |")
        if r["load_after"]:
            la = r["load_after"]
            print(f"after: running {la.get('num_running')}, waiting {la.get('num_waiting')}, "
                  f"free blocks {la.get('num_free_blocks')} / {la.get('num_total_blocks')}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "soak.json").write_text(json.dumps(reports, indent=1))


if __name__ == "__main__":
    main()

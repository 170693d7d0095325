"""How responsive is a worker's HTTP process while its engine runs a long prefill?

Sends one long-prompt completion (max_tokens=1, so the time is all prefill) and meanwhile polls
/health every --interval seconds; prints the /health latency percentiles while the prefill ran
and the prefill's own duration. The engine runs in its own process, so /health should answer in
milliseconds even though the prefill takes seconds (on a 2-core machine both share the CPUs).

usage: python benchmarks/health_during_prefill.py --url http://127.0.0.1:8000 [--prompt-tokens 6000]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import httpx


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def poll_health(client: httpx.AsyncClient, url: str, interval: float, stop: asyncio.Event,
                      latencies: list[float]) -> None:
    while not stop.is_set():
        start = time.perf_counter()
        response = await client.get(url + "/health")
        latencies.append(time.perf_counter() - start)
        assert response.status_code == 200
        await asyncio.sleep(interval)


async def main(args: argparse.Namespace) -> None:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(timeout=600, headers=headers) as client:
        idle: list[float] = []
        for _ in range(50):
            start = time.perf_counter()
            await client.get(args.url + "/health")
            idle.append(time.perf_counter() - start)
        prompt = " ".join(f"word{i % 97}" for i in range(args.prompt_tokens // 3))
        count = (await client.post(args.url + "/tokenize", json={"prompt": prompt})).json()["count"]
        stop, busy = asyncio.Event(), []
        poller = asyncio.create_task(poll_health(client, args.url, args.interval, stop, busy))
        start = time.perf_counter()
        response = await client.post(args.url + "/v1/completions",
                                     json={"prompt": prompt, "max_tokens": 1, "temperature": 0})
        prefill_seconds = time.perf_counter() - start
        stop.set()
        await poller
        response.raise_for_status()
    print(f"prompt tokens: {count}, prefill request: {prefill_seconds:.2f}s, "
          f"/health polls during it: {len(busy)}")
    print(f"{'':>16}{'p50 ms':>10}{'p90 ms':>10}{'p99 ms':>10}{'max ms':>10}")
    for name, values in (("idle", idle), ("during prefill", busy)):
        ms = [v * 1000 for v in values]
        print(f"{name:>16}{statistics.median(ms):>10.1f}{percentile(ms, 0.9):>10.1f}"
              f"{percentile(ms, 0.99):>10.1f}{max(ms):>10.1f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--prompt-tokens", type=int, default=6000)
    parser.add_argument("--interval", type=float, default=0.01)
    asyncio.run(main(parser.parse_args()))

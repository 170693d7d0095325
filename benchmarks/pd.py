"""Prefill/decode disaggregation versus one monolithic worker, on this machine.

    .venv/bin/python benchmarks/pd.py [--quick] [--parts a,b,c,d]

(a) inter-token latency under long prefills: the serve benchmark's agent scenario (sessions
    sharing a ~1,500-token system prompt with tools, histories growing over turns) while a
    stream of long-prompt requests arrives on a fixed schedule; ITL p50/p90/p99 of the agent
    streams, PD (`hearth up --prefill 1 --decode 1 --pin`: prefill on core 0, decode on core 1)
    versus `hearth up --workers 1` (one monolithic worker on both cores), same offered load.
(b) TTFT at a 2k-token prompt, idle stack, unique prompts: monolithic versus PD (unpinned, so
    both get both cores: this isolates the protocol's overhead) and PD pinned; also the latency
    of the second token, which under PD includes the KV transfer.
(c) KV transfer throughput per transport: runs benchmarks/kv_transfer.py (hearth/kv_transfer's own).
(d) prefix-cache hit ratio (cached_tokens / prompt_tokens as the client sees them) over a
    multi-turn agent workload on 2 prefill + 2 decode workers: cost policy with the
    x-session-affinity header, without it, and round robin. 3 sessions on 2 endpoints: with a
    multiple of 2 in lockstep, round robin would keep every session on one endpoint by accident.
Tables go to stdout, a PNG and the raw numbers to benchmarks/results/pd.{png,json}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
import serve as sb  # noqa: E402  (the serve benchmark: stream_chat, agent prompts, percentiles)

RESULTS = HERE / "results"
LOGS = Path(tempfile.gettempdir()) / "hearth-pd-bench"  # each stack's output, for post-mortems
MODEL = "smollm2-135m-instruct"
KEY = "bench-worker-key"


class Stack:
    """`hearth up ...` (or a bare router) as a child process; stopped with SIGTERM."""

    def __init__(self, name: str, args: list[str], port: int) -> None:
        self.name, self.port = name, port
        self.url = f"http://127.0.0.1:{port}"
        LOGS.mkdir(exist_ok=True)
        self.log = open(LOGS / f"{name}.log", "w")
        cmd = [sys.executable, "-m", "hearth.cli", *args, "--port", str(port), "--log-level", "warning",
               "--show-worker-urls"]  # endpoints() reads worker URLs off the router's /load
        self.process = subprocess.Popen(cmd, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT,
                                        env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def wait(self, timeout: float = 300) -> "Stack":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited; see {self.log.name}")
            try:
                view = httpx.get(self.url + "/load", timeout=2).json()
                if all(e["healthy"] for e in view["endpoints"]):
                    return self
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not healthy after {timeout}s")

    def endpoints(self) -> dict[str, list[str]]:
        view = httpx.get(self.url + "/load", timeout=5).json()["endpoints"]
        return {role: [e["url"] for e in view if e["role"] == role] for role in ("prefill", "decode", "both")}

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.log.close()


def up(name: str, port: int, *flags: str) -> Stack:
    stack = Stack(name, ["up", "--num-kv-blocks", "1024", "--worker-api-key", KEY, *flags], port).wait()
    warm_up(stack.url)
    return stack


def warm_up(url: str) -> None:
    """One untimed request per stack: the first forward pass of a fresh process is slow."""
    asyncio.run(sb.stream_chat(url, MODEL, [{"role": "user", "content": "warm up " * 50}], 4, {}))


# ---- workloads --------------------------------------------------------------------------------


async def agent_sessions(url: str, num_sessions: int, num_turns: int, max_tokens: int, seed: int,
                         session_header: bool = False, start_gap: float = 0.0) -> list[sb.RequestResult]:
    """The serve benchmark's agent scenario, optionally with an x-session-affinity per session."""
    rng = random.Random(seed)
    system = sb.agent_system_prompt(rng)
    results: list[sb.RequestResult] = []

    async def session(index: int) -> None:
        await asyncio.sleep(index * start_gap)
        local = random.Random(seed * 1000 + index)
        headers = {"x-session-affinity": f"s{seed}-{index}"} if session_header else {}
        messages = [{"role": "system", "content": system}]
        for turn in range(num_turns):
            messages.append({"role": "user", "content": f"Session {index} task {turn}: " + sb.words(local, 120)})
            result = await sb.stream_chat(url, MODEL, messages, max_tokens, headers)
            results.append(result)
            messages.append({"role": "assistant", "content": result.text or "ok"})
            messages.append({"role": "user", "content": "Tool result: " + sb.words(local, 150)})

    await asyncio.gather(*(session(i) for i in range(num_sessions)))
    return results


async def long_prompts(url: str, count: int, tokens: int, interval: float, seed: int) -> list[sb.RequestResult]:
    rng = random.Random(seed)

    async def one(i: int) -> sb.RequestResult:
        await asyncio.sleep(i * interval)
        prompt = f"Document {i} {rng.random():.6f}. Summarize: " + sb.words(rng, tokens)
        return await sb.stream_chat(url, MODEL, [{"role": "user", "content": prompt}], 8, {})

    return list(await asyncio.gather(*(one(i) for i in range(count))))


async def mixed(url: str, q: dict, seed: int) -> dict:
    load_before = os.getloadavg()[0]
    agents, longs = await asyncio.gather(
        agent_sessions(url, q["sessions"], q["turns"], q["max_tokens"], seed, start_gap=2.0),
        long_prompts(url, q["long_count"], q["long_tokens"], q["long_interval"], seed + 1))
    ok = [r for r in agents if r.ok]
    return {"itl_ms": sb.pcts([x for r in ok for x in r.itls]), "agent_ttft_ms": sb.pcts([r.ttft for r in ok]),
            "long_ttft_ms": sb.pcts([r.ttft for r in longs if r.ok]),
            "failed": sum(not r.ok for r in agents + longs), "num_itls": sum(len(r.itls) for r in ok),
            "loadavg_before": load_before}


async def ttft_2k(url: str, count: int, tokens: int, seed: int) -> dict:
    rng = random.Random(seed)
    load_before = os.getloadavg()[0]
    ttfts, seconds, failures = [], [], []
    for i in range(count):
        prompt = f"Report {seed}-{i} {rng.random():.6f}. Summarize: " + sb.words(rng, tokens)
        r = await sb.stream_chat(url, MODEL, [{"role": "user", "content": prompt}], 6, {})
        if r.ok and r.itls:
            ttfts.append(r.ttft)
            seconds.append(r.itls[0])
        else:
            failures.append(r.error or f"no second token: {r.text!r}")
    return {"ttft_ms": sb.pcts(ttfts), "second_token_ms": sb.pcts(seconds), "prompt_tokens": tokens,
            "loadavg_before": load_before, "failures": failures}


def hit_ratio(results: list[sb.RequestResult]) -> float:
    ok = [r for r in results if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    return sum(r.cached_tokens for r in ok) / prompt if prompt else float("nan")


# ---- parts ------------------------------------------------------------------------------------


def part_a(q: dict, port: int) -> dict:
    """(a) on both stacks; (b) first on each, while the stack is idle and warm."""
    out = {}
    for name, flags in (("monolithic", ["--prefill", "0", "--decode", "0", "--workers", "1"]),
                        ("pd_pinned", ["--prefill", "1", "--decode", "1", "--pin"])):
        stack = up(name, port, *flags)
        try:
            if q.get("b"):
                out[f"b_{name}"] = asyncio.run(ttft_2k(stack.url, q["ttft_count"], q["ttft_tokens"], 21))
            out[name] = asyncio.run(mixed(stack.url, q, seed=11))
        finally:
            stack.stop()
    return out


def part_b(q: dict, port: int) -> dict:
    stack = up("pd_unpinned", port, "--prefill", "1", "--decode", "1")
    try:
        return {"b_pd_unpinned": asyncio.run(ttft_2k(stack.url, q["ttft_count"], q["ttft_tokens"], 21))}
    finally:
        stack.stop()


def part_c() -> str:
    run = subprocess.run([sys.executable, str(HERE / "kv_transfer.py"), "--transports", "tcp,mooncake",
                          "--repeats", "3"], cwd=REPO, capture_output=True, text=True, timeout=300)
    # Keep the table; Mooncake logs its start-up on stderr.
    keep = [line for line in run.stdout.splitlines()
            if line.startswith(("KV transfer", "    MB", "mooncake:")) or line[:6].strip().replace(".", "").isdigit()]
    return "\n".join(keep) or (run.stdout + run.stderr).strip()[-2000:]


def part_d(q: dict, port: int) -> dict:
    stack = up("pd_2x2", port, "--prefill", "2", "--decode", "2")
    routers = []
    try:
        urls = stack.endpoints()
        rr = Stack("round_robin", ["route", "--prefill", *urls["prefill"], "--decode", *urls["decode"],
                                   "--worker-api-key", KEY, "--model", MODEL, "--policy", "round_robin"],
                   port + 1).wait()
        routers.append(rr)
        out = {}
        # A different seed per run: a different system prompt, so runs do not share caches.
        for label, url, header, seed in (("cost + session header", stack.url, True, 31),
                                         ("cost, no header", stack.url, False, 32),
                                         ("round robin", rr.url, False, 33)):
            results = asyncio.run(agent_sessions(url, q["d_sessions"], q["d_turns"], q["d_max_tokens"],
                                                 seed, session_header=header))
            out[label] = {"hit_ratio": hit_ratio(results), "failed": sum(not r.ok for r in results)}
        return out
    finally:
        for r in routers:
            r.stop()
        stack.stop()


# ---- report -----------------------------------------------------------------------------------


def report(results: dict) -> None:
    a = {k: results[k] for k in ("monolithic", "pd_pinned") if k in results}
    if a:
        print("\n(a) ITL of agent streams under long-prompt arrivals (same offered load)")
        print(f"{'config':<14}{'ITL p50/p90/p99 ms':>24}{'agent TTFT p50/p90 ms':>24}{'long TTFT p50 ms':>18}{'fail':>6}")
        for name, r in a.items():
            print(f"{name:<14}{'/'.join(f'{v:.0f}' for v in r['itl_ms']):>24}"
                  f"{'/'.join(f'{v:.0f}' for v in r['agent_ttft_ms'][:2]):>24}{r['long_ttft_ms'][0]:>18.0f}{r['failed']:>6}")
        if len(a) == 2:
            m, p = a["monolithic"]["itl_ms"], a["pd_pinned"]["itl_ms"]
            print(f"PD / monolithic ITL: p90 {p[1] / m[1]:.2f}, p99 {p[2] / m[2]:.2f}")
    b = {k: results[k] for k in ("b_monolithic", "b_pd_unpinned", "b_pd_pinned") if k in results}
    if b:
        print(f"\n(b) TTFT at a {next(iter(b.values()))['prompt_tokens']}-word prompt, idle stack")
        print(f"{'config':<16}{'TTFT p50 ms':>12}{'2nd token p50 ms':>18}")
        for name, r in b.items():
            print(f"{name[2:]:<16}{r['ttft_ms'][0]:>12.0f}{r['second_token_ms'][0]:>18.0f}")
        if "b_monolithic" in b and "b_pd_unpinned" in b:
            print(f"TTFT overhead PD (unpinned) vs monolithic: "
                  f"{b['b_pd_unpinned']['ttft_ms'][0] / b['b_monolithic']['ttft_ms'][0] - 1:+.1%}")
    if "kv_transfer" in results:
        print("\n(c) KV transfer (benchmarks/kv_transfer.py)\n" + results["kv_transfer"])
    if "d" in results:
        print("\n(d) prefix-cache hit ratio, multi-turn agent workload, 2 prefill + 2 decode")
        for label, r in results["d"].items():
            failed = f"  ({r['failed']} failed)" if r["failed"] else ""
            print(f"{label:<24}{r['hit_ratio']:>8.1%}{failed}")


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for name, color in (("monolithic", "tab:gray"), ("pd_pinned", "tab:blue")):
        if name in results:
            offset = -0.2 if name == "monolithic" else 0.2
            axes[0].bar([i + offset for i in range(3)], results[name]["itl_ms"], 0.4, label=name, color=color)
    axes[0].set_xticks(range(3), ["p50", "p90", "p99"])
    axes[0].set_ylabel("ms")
    axes[0].set_title("(a) ITL of agent streams under long prefills")
    axes[0].legend()
    b = [(k[2:], results[k]) for k in ("b_monolithic", "b_pd_unpinned", "b_pd_pinned") if k in results]
    axes[1].bar([n for n, _ in b], [r["ttft_ms"][0] for _, r in b], color="tab:orange", label="TTFT")
    axes[1].bar([n for n, _ in b], [r["second_token_ms"][0] for _, r in b], color="tab:green",
                bottom=[r["ttft_ms"][0] for _, r in b], label="2nd token")
    words = b[0][1]["prompt_tokens"] if b else 0
    axes[1].set_title(f"(b) {words}-word prompt, idle stack, p50 (ms)")
    axes[1].legend()
    d = results.get("d", {})
    axes[2].bar(list(d), [r["hit_ratio"] * 100 for r in d.values()], color="tab:purple")
    axes[2].set_ylim(0, 100)
    axes[2].set_title("(d) prefix-cache hit ratio (%)")
    axes[2].tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="a,b,c,d")
    p.add_argument("--quick", action="store_true", help="a smaller run (smoke test)")
    p.add_argument("--port", type=int, default=8400)
    p.add_argument("--keep", action="store_true", help="merge into the existing results/pd.json")
    a = p.parse_args()
    parts = set(a.parts.split(","))
    q = dict(sessions=3, turns=3, max_tokens=24, long_count=3, long_tokens=1500, long_interval=6.0,
             ttft_count=2, ttft_tokens=2000, d_sessions=3, d_turns=6, d_max_tokens=8, b="b" in parts)
    if a.quick:
        q.update(sessions=2, turns=2, max_tokens=16, long_count=2, long_tokens=600, long_interval=3.0,
                 ttft_count=1, ttft_tokens=600, d_sessions=3, d_turns=3, d_max_tokens=8)
    RESULTS.mkdir(exist_ok=True)
    params = {k: v for k, v in q.items() if k != "b"}
    results: dict = {"params": params}
    previous = RESULTS / "pd.json"
    if a.keep and previous.exists():  # parts run separately add up to one report
        results = {**json.loads(previous.read_text()), "params": params}
    started = time.monotonic()
    if "a" in parts:
        results.update(part_a(q, a.port))
    if "b" in parts:
        results.update(part_b(q, a.port))
    if "c" in parts:
        results["kv_transfer"] = part_c()
    if "d" in parts:
        results["d"] = part_d(q, a.port)
    results["wall_seconds"] = time.monotonic() - started
    report(results)
    (RESULTS / "pd.json").write_text(json.dumps(results, indent=2))
    plot(results, RESULTS / "pd.png")
    print(f"\nwrote {RESULTS / 'pd.json'} and {RESULTS / 'pd.png'} ({results['wall_seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

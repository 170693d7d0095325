"""KV tiers on real agent sessions: hit ratio, later-turn TTFT and total time, one run.

The workload is the coding-agent traces in ../shared/traces (hearth/bench/agent_replay.py scales
them: each 64-token trace block becomes --tokens-per-block words, outputs x1/16, think times x
--think-scale). Each trace is replayed --copies times as distinct sessions (its history private
to each copy, the harness prefix shared by all, as for many users of one agent), all sessions
at once, each sending its next turn after the previous answer plus its think time, with
`x-session-affinity: <session>`.

The working set is the distinct 16-token blocks of every session's last prompt (the KV that an
infinite cache would keep); the pool of the tiered configurations is --pool-fraction of it (but
at least the largest single prompt, or requests could not run at all). Configurations, each a
fresh `hearth up` (router + workers) on loopback:

  unbounded  one worker, a pool of 1.25 x the working set, no tiers (the reference)
  none       one worker, the small pool, no tiers (evicted prefixes are recomputed)
  disk       one worker, the small pool + --kv-offload-dir (a fresh directory)
  shared     two workers, half the small pool each (at least the largest prompt), one shared
             --kv-offload-dir
  vllm       vLLM-CPU with --enable-prefix-caching (its KV space is set in whole GiB, so its
             pool is at least 1 GiB: reported, not matched)

Reported per configuration: hit ratio (sum cached_tokens / sum prompt_tokens) against the
infinite-cache ceiling of the same send order (agent_replay.hit_ceiling, in trace blocks),
TTFT p50/p90 of later turns (every turn but a session's first), total wall time, prompt tokens
computed vs loaded (hearth's /metrics), and load seconds per block. Separately, in one process:
recompute vs load time of the same blocks (a 2,000-token prompt computed, evicted to the disk
tier, its page cache dropped, then loaded back) and the eviction-time staging copy.

usage: flock /tmp/hearth-heavy.lock .venv/bin/python benchmarks/kv_tiers.py
           [--configs unbounded,none,disk,shared,vllm] [--copies 2] [--requests 6]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import RequestResult, model_of, stream_chat  # noqa: E402

from hearth.bench import agent_replay  # noqa: E402
from hearth.bench.peer_servers import add_peer_path_args, hearth_argv, vllm_argv, vllm_env  # noqa: E402
from hearth.bench.server_process import ServerSpec, ServerStartError, start_server, stop_server  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).parent / "results"
BLOCK = 16
CONFIGS = ("unbounded", "none", "disk", "shared", "vllm")


def make_sessions(args) -> list[list[agent_replay.ReplayRequest]]:
    cfg = agent_replay.ReplayConfig(num_sessions=args.traces_used, requests_per_session=args.requests,
                                    tokens_per_block=args.tokens_per_block,
                                    think_time_scale=args.think_scale)
    paths = sorted(Path(args.traces).glob("trace_*.json"))[:args.traces_used]
    sessions = []
    for copy in range(args.copies):
        for path in paths:
            trace = json.loads(path.read_text())
            trace["id"] = f"{trace['id']}#{copy}"  # private history, shared harness
            sessions.append(agent_replay.session_requests(trace, cfg))
    return sessions


def working_set(sessions) -> tuple[int, int]:
    """(distinct blocks of every session's last prompt, blocks of the largest prompt)."""
    from hearth.engine.kv.block_hash import hash_blocks
    from hearth.engine.text.tokenizer import Tokenizer
    from hearth.models.loader import load_checkpoint
    from hearth.api.chat_prompt import render_chat_prompt
    from hearth.api.protocol import ChatMessage

    tokenizer = Tokenizer.from_checkpoint(load_checkpoint("smollm2-135m-instruct"))

    def ids(prompt: str) -> list[int]:
        text = render_chat_prompt(tokenizer, [ChatMessage(role="user", content=prompt)], None, True)
        return tokenizer.encode(text, add_special_tokens=False)
    blocks: set[int] = set()
    largest = 0
    for session in sessions:
        last = ids(session[-1].prompt)
        blocks.update(hash_blocks(last, BLOCK))
        largest = max(largest, -(-(len(last) + 64) // BLOCK))  # + room for its output
    return len(blocks), largest


def hearth_spec(name: str, port: int, workers: int, blocks: int, extra: list[str],
                log_dir: Path) -> ServerSpec:
    argv = hearth_argv("up", ["--prefill", "0", "--decode", "0", "--workers", str(workers),
                              "--num-kv-blocks", str(blocks), "--log-dir", str(log_dir / name), *extra])
    return ServerSpec(name, tuple(argv), port)


def vllm_spec(port: int, args) -> ServerSpec:
    argv = vllm_argv(args.vllm_python, args.hf_model, extra=[
        "--enable-prefix-caching", "--enable-prompt-tokens-details", "--dtype", "float32"])
    return ServerSpec("vllm", tuple(argv), port, vllm_env(args.vllm_kv_gib))


async def replay(url: str, sessions, stagger: float) -> tuple[list, list, float]:
    model = await model_of(url, {})
    sent: list[agent_replay.ReplayRequest] = []
    results: list[tuple[agent_replay.ReplayRequest, RequestResult]] = []

    async def session(k: int, requests) -> None:
        await asyncio.sleep(k * stagger)
        for request in requests:
            await asyncio.sleep(request.think_seconds)
            sent.append(request)
            headers = {"x-session-affinity": request.session_id}
            result = await stream_chat(url, model, [{"role": "user", "content": request.prompt}],
                                       request.max_tokens, headers)
            results.append((request, result))

    start = time.perf_counter()
    await asyncio.gather(*(session(k, s) for k, s in enumerate(sessions)))
    return sent, results, time.perf_counter() - start


def worker_metrics(router_url: str) -> dict[str, float]:
    """The workers' KV-tier counters summed, from the router's /load (each worker's last report;
    the router polls every --health-interval, so wait one interval first)."""
    time.sleep(1.5)
    totals: dict[str, float] = {}
    for endpoint in httpx.get(router_url + "/load", timeout=30).json()["endpoints"]:
        for tier, counters in (endpoint.get("report") or {}).get("kv_tiers", {}).items():
            for key, value in counters.items():
                totals[f"{tier}.{key}"] = totals.get(f"{tier}.{key}", 0.0) + float(value)
        report = endpoint.get("report") or {}
        for key in ("num_computed_prompt_tokens", "num_prompt_tokens", "num_cached_tokens",
                    "num_preemptions"):
            totals[key] = totals.get(key, 0) + report.get(key, 0)
    return totals


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(name: str, sent, results, wall: float, extra: dict) -> dict:
    failed = [r for _, r in results if not r.ok]
    ok = [(q, r) for q, r in results if r.ok]
    prompt = sum(r.prompt_tokens for _, r in ok)
    later = [r.ttft for q, r in ok if q.index > 0]
    return {"name": name, "requests": len(results), "failed": len(failed),
            "error": failed[0].error if failed else None,
            "prompt_tokens": prompt, "cached_tokens": sum(r.cached_tokens for _, r in ok),
            "hit_ratio": sum(r.cached_tokens for _, r in ok) / max(1, prompt),
            "hit_ceiling": agent_replay.hit_ceiling(sent),
            "later_ttft_p50_s": statistics.median(later) if later else float("nan"),
            "later_ttft_p90_s": pct(later, 0.9), "wall_s": wall, **extra}


async def run_config(name: str, args, sessions, ws: int, small: int, largest: int,
                     tmp: Path) -> dict:
    port = args.port
    log_dir = tmp / "logs"
    if name == "vllm":
        spec = vllm_spec(port, args)
        extra = {"pool": f"VLLM_CPU_KVCACHE_SPACE={args.vllm_kv_gib} GiB"}
    else:
        workers, blocks, flags = {
            "unbounded": (1, int(ws * 1.25), []),
            "none": (1, small, []),
            "disk": (1, small, ["--kv-offload-dir", str(tmp / "disk")]),
            "shared": (2, max(small // 2, largest), ["--kv-offload-dir", str(tmp / "shared"),
                                                     "--kv-offload-shared"]),
        }[name]
        spec = hearth_spec(name, port, workers, blocks, flags, log_dir)
        extra = {"pool": f"{workers} x {blocks} blocks"}
    print(f"\n## {name}: {shlex.join(spec.command())}", flush=True)
    try:
        server = start_server(spec, log_dir / f"{name}.log", args.start_timeout)
    except ServerStartError as exc:
        print(f"   not measured: {exc}", flush=True)
        return {"name": name, "error": str(exc), **extra}
    try:
        sent, results, wall = await replay(spec.url, sessions, args.stagger)
        if name != "vllm":
            extra["metrics"] = worker_metrics(spec.url)
    finally:
        stop_server(server)
    row = summarize(name, sent, results, wall, extra)
    print("   " + brief(row), flush=True)
    return row


def brief(row: dict) -> str:
    if "hit_ratio" not in row:
        return f"{row['name']}: {row.get('error')}"
    return (f"hit {row['hit_ratio']:.1%} of ceiling {row['hit_ceiling']:.1%}, later-turn TTFT "
            f"p50 {row['later_ttft_p50_s'] * 1000:.0f} ms p90 {row['later_ttft_p90_s'] * 1000:.0f} ms, "
            f"total {row['wall_s']:.1f} s, {row['failed']} failed")


def load_vs_recompute(tmp: Path) -> dict:
    """In one process: time a 2,000-token prefill, evict its blocks to a disk tier (timing the
    staging copies), drop their page cache, then time loading them back."""
    from dataclasses import replace

    from hearth.config import KVOffloadConfig
    from hearth.kv_tiers.store import make_store
    from hearth.engine.engine import LLMEngine
    from hearth.engine.llm import make_engine_config
    from hearth.engine.sampling_params import SamplingParams

    config = replace(make_engine_config("smollm2-135m-instruct", num_blocks=160),
                     kv_offload=KVOffloadConfig(directory=str(tmp / "micro")))
    engine = LLMEngine(config, store_factory=make_store)
    ids = [(7 * i + 11) % 20000 + 100 for i in range(2000)]
    params = SamplingParams(temperature=0.0, max_tokens=1)

    def run(rid: str, prompt: list[int] = ids) -> float:
        engine.add_request(rid, prompt, params)
        t0 = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        return time.perf_counter() - t0

    run("warm-up", [(13 * i + 5) % 20000 + 100 for i in range(2000)])  # other tokens
    compute_s = run("compute")  # every block computed: nothing of it is cached anywhere
    blocks = (len(ids) - 1) // BLOCK
    engine.tiers.poll()
    t0 = time.perf_counter()
    engine.pool.reset_cache()  # evicts every cached block: a staging copy each
    staging_s = time.perf_counter() - t0
    drain(engine)
    dropped = drop_page_cache(tmp / "micro")
    before = dict(engine.stats().kv_tiers["offload"])
    load_run_s = run("load")
    after = engine.stats().kv_tiers["offload"]
    loaded = after["load_blocks"] - before["load_blocks"]
    load_s = after["load_seconds"] - before["load_seconds"]
    engine.close()
    return {"blocks": blocks, "compute_s": compute_s, "compute_ms_per_block": compute_s / blocks * 1e3,
            "loaded_blocks": loaded, "load_s": load_s,
            "load_ms_per_block": load_s / max(1, loaded) * 1e3,
            "request_with_load_s": load_run_s, "page_cache_dropped": dropped,
            "staging_ms_per_block": staging_s / blocks * 1e3,
            "speedup": (compute_s / blocks) / max(1e-9, load_s / max(1, loaded))}


def drain(engine) -> None:
    deadline = time.monotonic() + 30
    while engine.tiers.store.counters["queue_depth"] and time.monotonic() < deadline:
        time.sleep(0.01)


def drop_page_cache(root: Path) -> bool:
    """posix_fadvise(DONTNEED) on our own files only (never the machine's whole cache)."""
    ok = True
    for path in root.rglob("*.kvb"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            ok = False
        finally:
            os.close(fd)
    return ok


def format_table(rows: list[dict]) -> str:
    lines = [f"{'config':<10}{'pool':<26}{'hit':>7}{'ceiling':>9}{'of ceil':>9}"
             f"{'TTFT p50':>10}{'p90':>8}{'total s':>9}{'loaded tok':>11}{'fail':>6}"]
    for r in rows:
        if "hit_ratio" not in r:
            lines.append(f"{r['name']:<10}{r.get('pool', ''):<26}not measured: {r.get('error')}")
            continue
        loaded = r.get("metrics", {}).get("offload.load_tokens", 0)
        lines.append(
            f"{r['name']:<10}{r['pool']:<26}{r['hit_ratio']:>7.1%}{r['hit_ceiling']:>9.1%}"
            f"{r['hit_ratio'] / max(1e-9, r['hit_ceiling']):>9.1%}"
            f"{r['later_ttft_p50_s'] * 1000:>8.0f}ms{r['later_ttft_p90_s'] * 1000:>6.0f}ms"
            f"{r['wall_s']:>9.1f}{loaded:>11.0f}{r['failed']:>6}")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [r for r in rows if "hit_ratio" in r]
    names = [r["name"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    axes[0].bar(names, [r["hit_ratio"] * 100 for r in rows], color="tab:blue", label="hit ratio")
    axes[0].plot(names, [r["hit_ceiling"] * 100 for r in rows], "k_", markersize=30,
                 label="infinite-cache ceiling")
    axes[0].set_ylabel("% of prompt tokens cached")
    axes[0].legend(loc="lower right", fontsize=8)
    axes[1].bar(names, [r["later_ttft_p50_s"] * 1000 for r in rows], color="tab:green", label="p50")
    axes[1].plot(names, [r["later_ttft_p90_s"] * 1000 for r in rows], "k_", markersize=30,
                 label="p90")
    axes[1].set_ylabel("later-turn TTFT (ms)")
    axes[1].legend(fontsize=8)
    axes[2].bar(names, [r["wall_s"] for r in rows], color="tab:orange")
    axes[2].set_ylabel("total time (s)")
    fig.suptitle("KV tiers on replayed agent sessions (pool = 1/4 of the working set)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--traces", default=str(REPO.parent / "shared/traces"))
    p.add_argument("--traces-used", type=int, default=11)
    p.add_argument("--copies", type=int, default=2, help="sessions per trace")
    p.add_argument("--requests", type=int, default=6, help="per session")
    p.add_argument("--tokens-per-block", type=int, default=1)
    p.add_argument("--think-scale", type=float, default=0.02)
    p.add_argument("--stagger", type=float, default=0.25, help="seconds between session starts")
    p.add_argument("--pool-fraction", type=float, default=0.25)
    p.add_argument("--port", type=int, default=8140)
    add_peer_path_args(p, llama=False)
    p.add_argument("--vllm-kv-gib", type=int, default=1)
    p.add_argument("--start-timeout", type=float, default=600)
    p.add_argument("--no-micro", action="store_true", help="skip the load-vs-recompute probe")
    p.add_argument("--out", default=str(RESULTS / "kv_tiers"))
    args = p.parse_args()
    sessions = make_sessions(args)
    ws, largest = working_set(sessions)
    small = max(int(ws * args.pool_fraction), largest + 8)
    header = {"sessions": len(sessions), "requests": sum(len(s) for s in sessions),
              "scaling": f"{args.tokens_per_block} words per 64-token trace block, think x{args.think_scale}, "
                         f"{args.copies} copies of {args.traces_used} traces",
              "working_set_blocks": ws, "largest_prompt_blocks": largest, "small_pool_blocks": small,
              "cpus": os.cpu_count()}
    print(json.dumps(header), flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="hearth-kv-tiers-") as tmp:
        for name in [c for c in args.configs.split(",") if c]:
            rows.append(asyncio.run(run_config(name, args, sessions, ws, small, largest + 8,
                                               Path(tmp))))
        micro = None if args.no_micro else load_vs_recompute(Path(tmp))
    print("\n" + format_table(rows))
    if micro:
        print(f"\nload vs recompute, {micro['blocks']} blocks of {BLOCK} tokens: compute "
              f"{micro['compute_ms_per_block']:.2f} ms/block, load {micro['load_ms_per_block']:.2f} "
              f"ms/block (page cache dropped: {micro['page_cache_dropped']}) -> {micro['speedup']:.0f}x; "
              f"staging copy at eviction {micro['staging_ms_per_block']:.3f} ms/block")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"header": header, "rows": rows, "micro": micro},
                                                   indent=2, default=str))
    if plot(rows, out.with_suffix(".png")):
        print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()

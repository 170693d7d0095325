"""Real-size models on one box: random-weight GGUFs of real shapes, served by hearth and by
llama-server from the same file, one server at a time.

  write   stream a GGUF of the shape to disk block by block (no float model ever exists; the
          default model's tokenizer stands in): hearth/models/random_gguf.py; Llama-3.1-8B and
          Qwen3-30B-A3B in Q4_K_M's mix, gpt-oss-20b (8 of 24 layers) in MXFP4 experts + Q8_0,
          Llama 4 Scout (4 of 48 layers) in Q4_K_M's mix; --layers overrides the layer count
  run     per server: start it (cold: process start -> /health 200), peak RSS of its whole
          process tree (sampled every 0.2 s from start to stop), then the figures of
          benchmarks/peers.py's Bench (--figures): prefill (tok/s of a ~2k-token prompt),
          decode100 (single-stream decode tok/s at ~100 tokens of context), batch8 (8
          concurrent streams' output tok/s), agent (the trace replay, 8 sessions at once:
          wall s, lower is better), decode6k (decode at --long-context-words of context);
          --repeats each, min and median, and hearth's median over each peer's. The OOM guard
          kills the server tree and records `OOM-guard` when MemAvailable falls under
          --min-available-gb (1.5).

usage:
  .venv/bin/python benchmarks/real_size.py write --shape llama8b --out /tmp/llama8b-q4km.gguf
  .venv/bin/python benchmarks/real_size.py run --gguf /tmp/llama8b-q4km.gguf \\
      --llama-server /tmp/peers/.../llama-server [--servers hearth,llamacpp] [--repeats 3]

Keep the machine otherwise quiet (2 cores): one server at a time, nothing else running.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

RESULTS = Path(__file__).parent / "results"

def write(shape: str, out: Path, mix: str | None, num_layers: int | None) -> None:
    import dataclasses

    from hearth.bench.peer_servers import default_gguf
    from hearth.models.random_gguf import SHAPES, write_random_gguf

    config = SHAPES[shape]
    if num_layers is not None:
        config = dataclasses.replace(config, num_layers=num_layers)
    print(f"{shape}: {config} ({mix or config.default_mix})", flush=True)
    write_random_gguf(out, config, default_gguf(), mix)
    print(f"wrote {out}: {out.stat().st_size / 2**30:.2f} GiB")


class TreeWatch(threading.Thread):
    """Peak resident memory of a process's descendants (sum of their VmRSS; the process itself
    not counted), sampled: started before a server is spawned, it sees the load's peak. The
    OOM guard: when the machine's MemAvailable falls under `guard_bytes`, every descendant is
    killed at once (the server tree; the benchmark itself survives) and `tripped` says why."""

    def __init__(self, pid: int, guard_bytes: int, every_s: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.pid, self.guard_bytes, self.every_s = pid, guard_bytes, every_s
        self.peak, self.tripped, self._done = 0, "", threading.Event()

    def run(self) -> None:
        while not self._done.is_set():
            self.peak = max(self.peak, tree_rss(self.pid, include_root=False))
            available = mem_available()
            if available < self.guard_bytes:  # killed at every sample under the line
                if not self.tripped:
                    self.tripped = (f"OOM-guard: MemAvailable {available / 1e9:.2f} GB < "
                                    f"{self.guard_bytes / 1e9:.2f} GB, server tree killed")
                    print(f"  {self.tripped}", flush=True)
                for pid in descendants(self.pid):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
            time.sleep(self.every_s)

    def finish(self) -> int:
        self._done.set()
        self.join()
        return self.peak


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable")


def descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def tree_rss(root: int, include_root: bool = True) -> int:
    total = 0
    for pid in [root] * include_root + descendants(root):
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def run(args: argparse.Namespace) -> None:
    from hearth.bench.peer_report import machine_header
    from hearth.bench.peer_servers import hearth_argv, llama_argv
    from hearth.bench.server_process import ServerSpec

    specs = {
        "hearth": ServerSpec("hearth", tuple(hearth_argv(extra=[
            "--model", args.gguf, "--max-model-len", str(args.context),
            *shlex.split(args.hearth_args)])), args.port),
        "llamacpp": ServerSpec("llamacpp", tuple(llama_argv(
            args.llama_server, args.gguf, args.context, 8, unified_kv=True,
            per_slot_context=args.context, extra=shlex.split(args.llamacpp_args))), args.port + 1),
    }
    RESULTS.mkdir(exist_ok=True)
    report: dict = {"gguf": args.gguf, "size_gib": Path(args.gguf).stat().st_size / 2**30,
                    "servers": {}}
    for name in args.servers.split(","):
        report["servers"][name] = measure(specs[name], args)
    report["machine"] = machine_header(probe_roofline=False)
    out = RESULTS / f"real_size_{Path(args.gguf).stem}.json"
    out.write_text(json.dumps(report, indent=1))
    print_table(report)
    plot(report, out.with_suffix(".png"))
    print(f"results: {out} (and .png)")


def measure(spec, args: argparse.Namespace) -> dict:
    """One server: started under the watch, warmed, each figure --repeats times; a start
    failure, a broken server or the OOM guard end it with `error` and what was measured."""
    import httpx
    from peers import Bench
    from serve import model_of

    from hearth.bench import agent_replay
    from hearth.bench.server_process import ServerStartError, start_server, stop_server

    bench_args = argparse.Namespace(
        prefill_words=args.prefill_words, decode_tokens=64, short_context_words=60,
        batch_tokens=32, long_context_words=args.long_context_words, turn_words=10,
        traces=args.traces, replay=agent_replay.ReplayConfig(
            num_sessions=args.agent_sessions, requests_per_session=args.agent_requests))
    print(f"## {spec.name}: {shlex.join(spec.command())}", flush=True)
    watch = TreeWatch(os.getpid(), int(args.min_available_gb * 1e9))
    watch.start()
    record: dict = {"figures": {}, "runs": {}}
    started = time.perf_counter()
    try:
        server = start_server(spec, RESULTS / f"real-size-{spec.name}.log", args.start_timeout)
    except ServerStartError as exc:
        record.update(error=watch.tripped or str(exc), peak_rss_gb=watch.finish() / 1e9,
                      cold_s=float("nan"))
        print(f"  not measured: {record['error']}", flush=True)
        return record
    record["cold_s"] = time.perf_counter() - started
    try:
        bench = Bench(spec.url, asyncio.run(model_of(spec.url, {})), bench_args, spec.name)
        asyncio.run(bench.decode100(-1))  # warm-up
        for figure in args.figures.split(","):
            runs = [asyncio.run(getattr(bench, figure)(rep)) for rep in range(args.repeats)]
            record["runs"][figure] = runs
            record["figures"][figure] = [r["value"] for r in runs]
            print(f"  {figure}: " + ", ".join(f"{r['value']:.2f}" for r in runs), flush=True)
    except (httpx.HTTPError, RuntimeError) as exc:  # the server broke: keep what was measured
        record["error"] = watch.tripped or str(exc)
        print(f"  stopped measuring: {record['error']}", flush=True)
    finally:
        stop_server(server)
        record["peak_rss_gb"] = watch.finish() / 1e9
    print(f"  cold {record['cold_s']:.1f} s, peak RSS of the tree {record['peak_rss_gb']:.2f} GB",
          flush=True)
    return record


def plot(report: dict, path: Path) -> None:
    """One panel per figure (and peak RSS, cold start): each server's median, min as a tick."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    servers = report["servers"]
    figures = sorted({f for r in servers.values() for f in r["figures"]})
    panels = [*figures, "peak RSS GB", "cold s"]
    fig, axes = plt.subplots(1, len(panels), figsize=(3 * len(panels), 3), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        names = list(servers)
        if panel == "peak RSS GB":
            meds = [servers[n]["peak_rss_gb"] for n in names]
            mins = meds
        elif panel == "cold s":
            meds = [servers[n]["cold_s"] for n in names]
            mins = meds
        else:
            vals = [servers[n]["figures"].get(panel, [float("nan")]) for n in names]
            meds, mins = [statistics.median(v) for v in vals], [min(v) for v in vals]
        meds, mins = ([0.0 if math.isnan(v) else v for v in x] for x in (meds, mins))  # not measured
        ax.bar(names, meds, color=["tab:orange" if n == "hearth" else "tab:blue" for n in names])
        ax.scatter(names, mins, color="black", marker="_", s=200)
        unit = "" if panel.endswith(("GB", " s")) else (
            " (s)" if panel in LOWER_IS_BETTER else " (tok/s)")
        ax.set_title(panel + unit, fontsize=9)
    fig.suptitle(Path(report["gguf"]).name, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def print_table(report: dict) -> None:
    servers = report["servers"]
    figures = sorted({f for r in servers.values() for f in r["figures"]})
    print(f"\n{'server':10} {'cold s':>7} {'RSS GB':>7} " +
          " ".join(f"{f + ' min/med':>20}" for f in figures))
    for name, r in servers.items():
        cells = []
        for f in figures:
            v = r["figures"].get(f)
            cells.append(f"{min(v):9.2f}/{statistics.median(v):<9.2f}" if v else " " * 20)
        print(f"{name:10} {r['cold_s']:7.1f} {r['peak_rss_gb']:7.2f} " + " ".join(cells))
    if "hearth" in servers and len(servers) > 1:
        for name, r in servers.items():
            if name == "hearth":
                continue
            ours = servers["hearth"]
            ratios = {f: ratio(statistics.median(ours["figures"][f]),
                               statistics.median(r["figures"][f]), f in LOWER_IS_BETTER)
                      for f in figures if r["figures"].get(f) and ours["figures"].get(f)}
            print(f"hearth vs {name} (>1: hearth better): "
                  + ", ".join(f"{f} {v:.2f}x" for f, v in ratios.items())
                  + f", RSS {ratio(ours['peak_rss_gb'], r['peak_rss_gb'], True):.2f}x"
                  + f", cold {ratio(ours['cold_s'], r['cold_s'], True):.2f}x")
    for name, r in servers.items():
        if "error" in r:
            print(f"{name}: {r['error']}")


LOWER_IS_BETTER = {"agent", "turn"}  # seconds, not tok/s


def ratio(ours: float, theirs: float, lower_is_better: bool) -> float:
    num, den = (theirs, ours) if lower_is_better else (ours, theirs)
    return num / den if den else float("nan")


def main() -> None:
    from hearth.bench.peer_servers import LLAMA_SERVER
    from hearth.models.random_gguf import MIXES, SHAPES

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write")
    w.add_argument("--shape", choices=sorted(SHAPES), default="llama8b")
    w.add_argument("--mix", choices=MIXES, default=None,
                   help="default: the shape's (mxfp4 for gpt-oss, else q4_k_m)")
    w.add_argument("--layers", type=int, default=None, help="override the shape's layer count")
    w.add_argument("--out", type=Path, required=True)
    r = sub.add_parser("run")
    r.add_argument("--gguf", required=True)
    r.add_argument("--llama-server", default=LLAMA_SERVER)
    r.add_argument("--servers", default="hearth,llamacpp")
    r.add_argument("--figures", default="prefill,decode100,batch8,agent")
    r.add_argument("--repeats", type=int, default=3)
    r.add_argument("--context", type=int, default=8192)
    r.add_argument("--prefill-words", type=int, default=1500, help="~2k tokens")
    r.add_argument("--long-context-words", type=int, default=6000,
                   help="decode6k / prefilllong / turn (16000 with --context 20480: ~16k)")
    r.add_argument("--traces", default=str(Path(__file__).resolve().parents[2] / "shared/traces"))
    r.add_argument("--agent-sessions", type=int, default=8)
    r.add_argument("--agent-requests", type=int, default=8, help="per session")
    r.add_argument("--min-available-gb", type=float, default=1.5,
                   help="OOM guard: kill the server tree when MemAvailable falls under this")
    r.add_argument("--start-timeout", type=float, default=900)
    r.add_argument("--port", type=int, default=8100, help="hearth's; llama-server's is the next")
    r.add_argument("--hearth-args", default="")
    r.add_argument("--llamacpp-args", default="")
    args = parser.parse_args()
    if args.command == "write":
        write(args.shape, args.out, args.mix, args.layers)
    else:
        run(args)


if __name__ == "__main__":
    main()

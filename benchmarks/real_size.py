"""Real-size models on one box: random-weight GGUFs of real shapes in Q4_K_M's block mix, served
by hearth and by llama-server from the same file, one server at a time.

  write   stream a GGUF of the shape to disk block by block (no float model ever exists; the
          default model's tokenizer stands in): hearth/models/random_gguf.py, Q4_K_M's mix
  run     per server: start it (cold: process start -> /health 200), peak RSS of its whole
          process tree (sampled every 0.2 s from start to stop), prefill tok/s of a ~2k-token
          prompt, single-stream decode tok/s at ~100 tokens of context, 8 concurrent streams'
          output tok/s; --repeats each, min and median, and hearth's median over each peer's

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
import os
import shlex
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


class TreeRss(threading.Thread):
    """Peak resident memory of a process's descendants (sum of their VmRSS; the process itself
    not counted), sampled: started before a server is spawned, it sees the load's peak."""

    def __init__(self, pid: int, every_s: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.pid, self.every_s, self.peak, self._done = pid, every_s, 0, threading.Event()

    def run(self) -> None:
        while not self._done.is_set():
            self.peak = max(self.peak, tree_rss(self.pid, include_root=False))
            time.sleep(self.every_s)

    def finish(self) -> int:
        self._done.set()
        self.join()
        return self.peak


def tree_rss(root: int, include_root: bool = True) -> int:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        if pid == root and not include_root:
            continue
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def run(args: argparse.Namespace) -> None:
    from peers import Bench

    from hearth.bench.peer_servers import hearth_argv, llama_argv
    from hearth.bench.server_process import ServerSpec, start_server, stop_server

    specs = {
        "hearth": ServerSpec("hearth", tuple(hearth_argv(extra=[
            "--model", args.gguf, "--max-model-len", str(args.context),
            *shlex.split(args.hearth_args)])), 8100),
        "llamacpp": ServerSpec("llamacpp", tuple(llama_argv(
            args.llama_server, args.gguf, args.context, 8, extra=shlex.split(args.llamacpp_args))),
            8101),
    }
    bench_args = argparse.Namespace(prefill_words=args.prefill_words, decode_tokens=64,
                                    short_context_words=60, batch_tokens=32,
                                    long_context_words=100, turn_words=10)
    RESULTS.mkdir(exist_ok=True)
    report: dict = {"gguf": args.gguf, "size_gib": Path(args.gguf).stat().st_size / 2**30,
                    "servers": {}}
    for name in args.servers.split(","):
        spec = specs[name]
        print(f"## {name}: {shlex.join(spec.command())}", flush=True)
        watch = TreeRss(os.getpid())
        watch.start()
        started = time.perf_counter()
        server = start_server(spec, RESULTS / f"real-size-{name}.log", args.start_timeout)
        cold = time.perf_counter() - started
        record: dict = {"cold_s": cold, "figures": {}}
        try:
            from serve import model_of

            bench = Bench(spec.url, asyncio.run(model_of(spec.url, {})), bench_args, name)
            asyncio.run(bench.decode100(-1))  # warm-up
            for figure in args.figures.split(","):
                method = getattr(bench, figure)
                values = [asyncio.run(method(rep))["value"] for rep in range(args.repeats)]
                record["figures"][figure] = values
                print(f"  {figure}: " + ", ".join(f"{v:.2f}" for v in values), flush=True)
        finally:
            stop_server(server)
            record["peak_rss_gb"] = watch.finish() / 1e9
        print(f"  cold {cold:.1f} s, peak RSS of the tree {record['peak_rss_gb']:.2f} GB", flush=True)
        report["servers"][name] = record
    from hearth.bench.peer_report import machine_header

    report["machine"] = machine_header(probe_roofline=False)
    out = RESULTS / f"real_size_{Path(args.gguf).stem}.json"
    out.write_text(json.dumps(report, indent=1))
    print_table(report)
    plot(report, out.with_suffix(".png"))
    print(f"results: {out} (and .png)")


def plot(report: dict, path: Path) -> None:
    """One panel per figure (and peak RSS, cold start): each server's median, min as a tick."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    servers = report["servers"]
    figures = sorted({f for r in servers.values() for f in r["figures"]})
    panels = [*figures, "peak RSS GB", "cold s"]
    fig, axes = plt.subplots(1, len(panels), figsize=(3 * len(panels), 3))
    for ax, panel in zip(axes, panels):
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
        ax.bar(names, meds, color=["tab:orange" if n == "hearth" else "tab:blue" for n in names])
        ax.scatter(names, mins, color="black", marker="_", s=200)
        ax.set_title(panel + ("" if panel.endswith(("GB", " s")) else " (tok/s)"), fontsize=9)
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
            ratios = {f: statistics.median(servers["hearth"]["figures"][f]) /
                      statistics.median(r["figures"][f])
                      for f in figures if f in r["figures"] and f in servers["hearth"]["figures"]}
            print(f"hearth / {name}: " + ", ".join(f"{f} {v:.2f}x" for f, v in ratios.items())
                  + f", RSS {servers['hearth']['peak_rss_gb'] / r['peak_rss_gb']:.2f}x"
                  + f", cold {servers['hearth']['cold_s'] / r['cold_s']:.2f}x")


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
    r.add_argument("--figures", default="prefill,decode100,batch8")
    r.add_argument("--repeats", type=int, default=3)
    r.add_argument("--context", type=int, default=8192)
    r.add_argument("--prefill-words", type=int, default=1500)
    r.add_argument("--start-timeout", type=float, default=900)
    r.add_argument("--hearth-args", default="")
    r.add_argument("--llamacpp-args", default="")
    args = parser.parse_args()
    if args.command == "write":
        write(args.shape, args.out, args.mix, args.layers)
    else:
        run(args)


if __name__ == "__main__":
    main()

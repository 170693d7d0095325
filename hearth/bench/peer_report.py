"""The machine header, tables, ratios and plot of benchmarks/peers.py, from its JSON-able report.

A report is {"header": {...}, "servers": {name: {"figures": {figure: [repeat, ...]}}}} where each
repeat is a dict with "value" (the figure's number, NaN when the repeat failed) and extras.
Servers whose name starts with "hearth" are divided by every other server in the ratio table.
"""

from __future__ import annotations

import math
import os
import platform
import statistics
import time
from pathlib import Path

# figure -> (label, unit, higher is better)
FIGURE_INFO = {
    "cold": ("cold start", "s", False),
    "prefill": ("prefill ~2k prompt", "tok/s", True),
    "decode100": ("decode, ~100 ctx", "tok/s", True),
    "decode6k": ("decode, long ctx", "tok/s", True),
    "prefilllong": ("prefill, long prompt", "tok/s", True),
    "turn": ("later turn TTFT (+~1k over cached long)", "s", False),
    "batch8": ("8 streams, output", "tok/s", True),
    "batch32": ("32 streams, output", "tok/s", True),
    "agent": ("agent replay wall", "s", False),
    "neighbour": ("decode beside busy core", "tok/s", True),
}
# (figure, key of its repeats) -> (label, unit, higher is better): a second number of a figure,
# tabled and divided like the figures' own values (issue 44's latency goals)
SUB_FIGURES = {
    ("agent", "later_ttft_p50_s"): ("agent replay, later-turn TTFT p50", "s", False),
    ("agent", "later_ttft_p90_s"): ("agent replay, later-turn TTFT p90", "s", False),
    ("agent", "itl_p90_ms"): ("agent replay, ITL p90", "ms", False),
    ("batch8", "itl_p90_ms"): ("8 streams, ITL p90", "ms", False),
    ("batch32", "itl_p90_ms"): ("32 streams, ITL p90", "ms", False),
}
# hearth's TTFT parts on /metrics (docs/api.md, "Where a TTFT goes") -> the key of their mean
TTFT_PARTS = {
    "request_queue_time_seconds": "queue_s",
    "request_prompt_chunks_seconds": "prompt_chunks_s",
    "request_first_step_seconds": "first_step_s",
    "request_ttft_outside_engine_seconds": "outside_engine_s",
    "request_first_step_tokens": "first_step_tokens",
}
CPU_FLAG_PREFIXES = ("avx2", "avx512", "amx", "avx_vnni", "fma", "f16c")


def cpu_flags() -> list[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    line = next((l for l in text.splitlines() if l.startswith("flags")), "")
    return sorted({f for f in line.split(":", 1)[-1].split() if f.startswith(CPU_FLAG_PREFIXES)})


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _timed_rate(step, work_per_step: float, seconds: float = 0.7) -> float:
    step()  # warm-up
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        step()
        count += 1
    return work_per_step * count / (time.perf_counter() - start)


def roofline() -> dict:
    """Rough peaks with torch on this machine: GEMM GFLOP/s per dtype and copy GB/s."""
    import torch
    out = {}
    n = 1024
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        out[f"gemm_{str(dtype).split('.')[-1]}_gflops"] = _timed_rate(lambda: a @ b, 2 * n**3 / 1e9)
    src = torch.ones(64 * 2**20)  # 256 MiB fp32
    dst = torch.empty_like(src)
    out["copy_gb_s"] = _timed_rate(lambda: dst.copy_(src), 2 * src.numel() * 4 / 1e9)  # read + write
    return out


def machine_header(probe_roofline: bool = True) -> dict:
    import torch
    header = {"cpu": cpu_model(), "cores": os.cpu_count(), "cpu_flags": cpu_flags(),
              "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
              "load_average": os.getloadavg(), "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    if probe_roofline:
        header["roofline"] = roofline()
    return header


def format_header(h: dict) -> str:
    lines = [f"# peers benchmark, {h['date']}",
             f"CPU: {h['cpu']}, {h['cores']} cores; flags: {' '.join(h['cpu_flags']) or '?'}",
             f"torch {h['torch']}, {h['torch_threads']} threads; load average "
             + " ".join(f"{x:.2f}" for x in h["load_average"])]
    if "roofline" in h:
        r = h["roofline"]
        lines.append(f"torch peaks here: fp32 GEMM {r['gemm_float32_gflops']:.0f} GFLOP/s, "
                     f"bf16 GEMM {r['gemm_bfloat16_gflops']:.0f} GFLOP/s, copy {r['copy_gb_s']:.1f} GB/s")
    if "agent_scaling" in h:
        lines.append(f"agent replay scaling: {h['agent_scaling']}")
    return "\n".join(lines)


def quantile(samples: list[float], q: float) -> float:
    """The nearest-rank `q` quantile (NaN for no samples)."""
    if not samples:
        return float("nan")
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def histogram_totals(metrics_text: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of each TTFT-part histogram in a hearth worker's /metrics text (summed over
    label sets); empty for a server that has none (a peer)."""
    totals: dict[str, list[float]] = {}
    for line in metrics_text.splitlines():
        name, _, rest = line.partition("{")
        for suffix, slot in (("_sum", 0), ("_count", 1)):
            metric = name.removeprefix("hearth:").removesuffix(suffix)
            if name.startswith("hearth:") and name.endswith(suffix) and metric in TTFT_PARTS:
                totals.setdefault(metric, [0.0, 0.0])[slot] += float(rest.rsplit(" ", 1)[-1])
    return {k: (v[0], v[1]) for k, v in totals.items()}


def ttft_part_means(before: dict, after: dict) -> dict[str, float]:
    """The mean of each TTFT part over the requests that finished between two readings of
    `histogram_totals` (keys of TTFT_PARTS' values; empty when there were none)."""
    means = {}
    for metric, key in TTFT_PARTS.items():
        total, count = after.get(metric, (0.0, 0.0))
        total0, count0 = before.get(metric, (0.0, 0.0))
        if count > count0:
            means[key] = (total - total0) / (count - count0)
    return means


def values(runs: list[dict], key: str = "value") -> list[float]:
    return [r[key] for r in runs if key in r and isinstance(r[key], (int, float)) and not math.isnan(r[key])]


def median(runs: list[dict], key: str = "value") -> float:
    v = values(runs, key)
    return statistics.median(v) if v else float("nan")


def brief(run: dict) -> str:
    return ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in run.items())


def _notes(figure: str, runs: list[dict]) -> str:
    failed = sum(1 for r in runs if "error" in r)
    notes = [f"{failed} failed: {next(r['error'] for r in runs if 'error' in r)[:60]}"] if failed else []
    if figure == "cold" and len(values(runs)) > 1:
        notes.append(f"first start {values(runs)[0]:.3g} s, then restarts")
    if figure == "agent" and values(runs):
        notes.append(f"hit {median(runs, 'hit_ratio'):.3f} of ceiling {median(runs, 'hit_ceiling'):.3f}, "
                     f"{median(runs, 'output_tok_s'):.1f} out tok/s, {median(runs, 'num_requests'):.0f} req")
        if values(runs, "first_step_s"):  # hearth: where a TTFT went, mean per request
            notes.append("TTFT parts (mean, all turns): " + ", ".join(
                f"{key[:-2].replace('_', ' ')} {median(runs, key) * 1000:.0f} ms"
                for key in ("queue_s", "prompt_chunks_s", "first_step_s", "outside_engine_s"))
                + f", first step {median(runs, 'first_step_tokens'):.0f} tokens")
    elif figure in ("prefill", "decode100", "decode6k", "prefilllong", "turn", "neighbour") and values(runs):
        notes.append(f"{median(runs, 'prompt_tokens'):.0f} prompt tokens")
    elif figure.startswith("batch") and values(runs):
        notes.append(f"ITL p50 {median(runs, 'itl_median_ms'):.0f} ms")
    return "; ".join(notes)


def _fmt(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.3g}" if abs(x) < 100 else f"{x:.0f}"


def server_table(name: str, record: dict) -> str:
    rows = [f"### {name}", "", "| figure | unit | n | min | median | notes |", "|---|---|---|---|---|---|"]
    for figure in (f for f in FIGURE_INFO if f in record.get("figures", {})):
        runs = record["figures"][figure]
        label, unit, _ = FIGURE_INFO[figure]
        v = values(runs)
        rows.append(f"| {label} | {unit} | {len(v)} | {_fmt(min(v)) if v else '-'} | "
                    f"{_fmt(median(runs))} | {_notes(figure, runs)} |")
        for (of, key), (label, unit, _) in SUB_FIGURES.items():
            v = values(runs, key) if of == figure else []
            if v:
                rows.append(f"| {label} | {unit} | {len(v)} | {_fmt(min(v))} | "
                            f"{_fmt(median(runs, key))} | |")
    figures = record.get("figures", {})
    if "decode100" in figures and "decode6k" in figures:
        rows.append(f"| decode step 6k / 100 ctx | x | | | "
                    f"{_fmt(median(figures['decode100']) / median(figures['decode6k']))} | goal <= 1.3 |")
    return "\n".join(rows)


def ratio_table(servers: dict) -> str:
    mine = [n for n in servers if n.startswith("hearth") and servers[n].get("figures")]
    peers = [n for n in servers if not n.startswith("hearth") and servers[n].get("figures")]
    pairs = [(h, p) for h in mine for p in peers]
    if not pairs:
        return ""
    rows = ["### ratios (median / median)", "",
            "| figure | better | " + " | ".join(f"{h} / {p}" for h, p in pairs) + " |",
            "|---|---|" + "---|" * len(pairs)]
    figures = [f for f in FIGURE_INFO if any(f in servers[n]["figures"] for n in mine + peers)]
    for figure in figures:
        label, _, higher = FIGURE_INFO[figure]
        cells = _ratios(servers, pairs, figure, "value")
        rows.append(f"| {label} | {'higher' if higher else 'lower'} | " + " | ".join(cells) + " |")
        for (of, key), (label, _, higher) in SUB_FIGURES.items():
            cells = _ratios(servers, pairs, figure, key) if of == figure else []
            if any(c != "-" for c in cells):
                rows.append(f"| {label} | {'higher' if higher else 'lower'} | "
                            + " | ".join(cells) + " |")
    return "\n".join(rows)


def _ratios(servers: dict, pairs: list[tuple[str, str]], figure: str, key: str) -> list[str]:
    cells = []
    for h, p in pairs:
        a = median(servers[h]["figures"].get(figure, []), key)
        b = median(servers[p]["figures"].get(figure, []), key)
        cells.append(_fmt(a / b) + "x" if b and not math.isnan(a / b) else "-")
    return cells


def format_report(report: dict) -> str:
    parts = [server_table(n, r) for n, r in report["servers"].items()]
    return "\n\n".join([*parts, ratio_table(report["servers"])])


def plot(report: dict, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no PNG")
        return False
    servers = {n: r["figures"] for n, r in report["servers"].items() if r.get("figures")}
    figures = [f for f in FIGURE_INFO if any(f in figs for figs in servers.values())]
    if not figures:
        return False
    cols = min(4, len(figures))
    rows = math.ceil(len(figures) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3.2 * rows), squeeze=False)
    names = list(servers)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, figure in zip(axes.flat, figures):
        label, unit, higher = FIGURE_INFO[figure]
        meds = [median(servers[n].get(figure, [])) for n in names]
        lows = [min(values(servers[n].get(figure, [])), default=float("nan")) for n in names]
        highs = [max(values(servers[n].get(figure, [])), default=float("nan")) for n in names]
        err = [[0 if math.isnan(m) else m - lo for m, lo in zip(meds, lows)],
               [0 if math.isnan(m) else hi - m for m, hi in zip(meds, highs)]]
        ax.bar(range(len(names)), [0 if math.isnan(m) else m for m in meds], yerr=err,
               color=[colors[i % len(colors)] for i in range(len(names))], capsize=3)
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
        ax.set_title(f"{label} ({unit}, {'higher' if higher else 'lower'} is better)", fontsize=9)
    for ax in list(axes.flat)[len(figures):]:
        ax.axis("off")
    fig.suptitle(f"hearth vs peers, median of repeats (bars: min-max) — {report['header']['cpu']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True

"""RSS of the HTTP processes before and after a burst of bodies at and past the body limit.

    .venv/bin/python benchmarks/doorway_memory.py [--bodies 300] [--max-body-mb 8] [--targets serve,route]

The burst (seeded, in turn): valid JSON just under the limit (one long string: a 400 for a
prompt past the context), a JSON array of small numbers just under the limit (millions of
objects to decode: a 400), a declared Content-Length past the limit (413 before reading),
a chunked body past the limit (413 once counted), and malformed JSON just under the limit.
`serve` is one worker (the default model); `route` a router in front of a worker that is not
there (every body is read and decoded, then a 503). Prints the RSS (MiB) of the HTTP process
before, after, and after 2 s of quiet; writes benchmarks/results/doorway_memory.json. Not a
test: nothing is asserted (tests/e2e/test_doorway_limits.py holds a generous bound).
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

RESULTS = Path(__file__).parent / "results"
MODEL = "smollm2-135m-instruct"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rss_mib(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


def bodies(limit: int, count: int):
    """(label, content or iterator of chunks, headers) per request, cycling through the kinds."""
    text = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": ""}]})
    pad = limit - len(text) - 16
    under_text = text.replace('"content": ""', '"content": "' + "x" * pad + '"').encode()
    numbers = b"[" + b"1," * ((limit - 16) // 2) + b"1]"
    malformed = b'{"model": "' + b"y" * (limit - 64) + b'", '
    over = b"z" * (limit + 1024)
    kinds = [("under_text", under_text), ("under_numbers", numbers), ("over_declared", over),
             ("over_chunked", None), ("malformed", malformed)]
    for i in range(count):
        label, content = kinds[i % len(kinds)]
        if content is None:
            yield label, (over[j:j + 2**20] for j in range(0, len(over), 2**20)), {}
        else:
            yield label, content, {"content-type": "application/json"}


def wait_ready(url: str, process: subprocess.Popen, path: str = "/health") -> None:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError("process exited")
        try:
            if httpx.get(url + path, timeout=2).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{url} not ready")


def start(target: str, port: int, max_body_mb: float) -> subprocess.Popen:
    base = [sys.executable, "-m", "hearth.cli"]
    if target == "serve":
        cmd = [*base, "serve", "--model", MODEL, "--port", str(port), "--no-access-log"]
    else:  # a router in front of a worker that is not there
        cmd = [*base, "route", "--port", str(port), "--worker", f"http://127.0.0.1:{free_port()}",
               "--no-access-log", "--health-interval", "5"]
    return subprocess.Popen([*cmd, "--max-body-mb", str(max_body_mb)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def run(target: str, count: int, max_body_mb: float) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = start(target, port, max_body_mb)
    try:
        wait_ready(url, process, "/health" if target == "serve" else "/load")
        before = rss_mib(process.pid)
        statuses: dict[str, dict[int, int]] = {}
        peak = before
        with httpx.Client(timeout=120) as client:
            for label, content, headers in bodies(int(max_body_mb * 2**20), count):
                try:
                    status = client.post(url + "/v1/chat/completions", content=content,
                                         headers=headers).status_code
                except httpx.HTTPError:
                    status = -1  # the server answered 413 and closed while we were sending
                counts = statuses.setdefault(label, {})
                counts[status] = counts.get(status, 0) + 1
                peak = max(peak, rss_mib(process.pid))
        after = rss_mib(process.pid)
        time.sleep(2)
        settled = rss_mib(process.pid)
        return {"target": target, "bodies": count, "max_body_mb": max_body_mb,
                "rss_before_mib": round(before, 1), "rss_peak_mib": round(peak, 1),
                "rss_after_mib": round(after, 1), "rss_settled_mib": round(settled, 1),
                "statuses": statuses}
    finally:
        process.terminate()
        process.wait(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bodies", type=int, default=300)
    ap.add_argument("--max-body-mb", type=float, default=8)
    ap.add_argument("--targets", default="serve,route")
    args = ap.parse_args()
    rows = [run(t, args.bodies, args.max_body_mb) for t in args.targets.split(",")]
    print(f"{'target':8} {'bodies':>6} {'limit MiB':>9} {'before':>8} {'peak':>8} {'after':>8} "
          f"{'settled':>8}")
    for r in rows:
        print(f"{r['target']:8} {r['bodies']:>6} {r['max_body_mb']:>9g} {r['rss_before_mib']:>8} "
              f"{r['rss_peak_mib']:>8} {r['rss_after_mib']:>8} {r['rss_settled_mib']:>8}")
        print(f"         statuses: {r['statuses']}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "doorway_memory.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()

"""How many PD clients that drop right after the first token it takes to exhaust a prefill pool.

    .venv/bin/python benchmarks/pd_drop.py [--num-kv-blocks 96] [--drops 12] [--prompt-words 180]

Starts one prefill worker, one decode worker and a router on loopback (the default model). Each
"dropper" sends a streamed chat request with a unique prompt, reads until the first content
chunk arrives and closes the connection, so the router never sends (or abandons) the decode hop
and the prefill worker's lease on the prompt's blocks waits for its expiry. Each drop's own
time to first token shows when a prefill had to wait for blocks; after each drop the prefill
worker's /load says how many blocks are free and how many leases are held; then one
ordinary request (a fresh prompt of the same size) shows whether a new prefill still gets
blocks: its time to first token and what the prefill worker computed for it.

Prints a table; the raw numbers go to benchmarks/results/pd_drop.json.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"
LOGS = Path(tempfile.gettempdir()) / "hearth-pd-drop"
MODEL = "smollm2-135m-instruct"
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november "
         "oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(name: str, command: str, *args: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    LOGS.mkdir(exist_ok=True)
    log = open(LOGS / f"{name}.log", "w")
    cmd = [sys.executable, "-m", "hearth.cli", command, "--port", str(port), "--log-level",
           "warning", *args]
    process = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited; see {log.name}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{name} not healthy; see {log.name}")


def prompt(seed: int, num_words: int) -> list[dict]:
    words = [WORDS[(seed * 7 + i * (seed % 5 + 1)) % len(WORDS)] for i in range(num_words)]
    return [{"role": "user", "content": f"Request {seed}: " + " ".join(words)}]


def body(seed: int, num_words: int) -> dict:
    return {"model": MODEL, "messages": prompt(seed, num_words), "max_tokens": 32,
            "temperature": 0, "stream": True}


def drop_after_first_token(router: str, seed: int, num_words: int) -> float:
    """Seconds until the first token came (then the connection is dropped)."""
    start_time = time.monotonic()
    with httpx.stream("POST", router + "/v1/chat/completions", json=body(seed, num_words),
                      timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and '"content"' in line:
                break  # leaving the with-block closes the connection
    return time.monotonic() - start_time


def probe(router: str, seed: int, num_words: int) -> dict:
    """One ordinary streamed request: seconds to its first content chunk, and to its end."""
    start_time = time.monotonic()
    ttft = None
    try:
        with httpx.stream("POST", router + "/v1/chat/completions", json=body(seed, num_words),
                          timeout=120) as response:
            for line in response.iter_lines():
                if ttft is None and line.startswith("data: ") and '"content"' in line:
                    ttft = time.monotonic() - start_time
        return {"ok": response.status_code == 200, "ttft_s": ttft,
                "total_s": time.monotonic() - start_time}
    except httpx.HTTPError as exc:
        return {"ok": False, "error": str(exc), "total_s": time.monotonic() - start_time}


def load(url: str) -> dict:
    return httpx.get(url + "/load", timeout=30).json()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-kv-blocks", type=int, default=96)
    p.add_argument("--drops", type=int, default=12)
    p.add_argument("--prompt-words", type=int, default=180)
    p.add_argument("--lease-seconds", type=float, default=30.0)
    p.add_argument("--label", default="run")
    a = p.parse_args()
    worker = ("--model", MODEL, "--host", "127.0.0.1", "--num-kv-blocks", str(a.num_kv_blocks),
              "--kv-secret", "bench", "--kv-lease-seconds", str(a.lease_seconds))
    processes = []
    try:
        prefill_proc, prefill = start("prefill", "serve", *worker, "--role", "prefill")
        processes.append(prefill_proc)
        decode_proc, decode = start("decode", "serve", *worker, "--role", "decode")
        processes.append(decode_proc)
        router_proc, router = start("router", "route", "--model", MODEL,
                                    "--prefill", prefill, "--decode", decode,
                                    "--health-interval", "0.5")
        processes.append(router_proc)
        probe(router, 10_000, a.prompt_words)  # warm-up (and the prompt's size in blocks)
        base = load(prefill)
        rows = [{"drops": 0, "ttft_s": None, "free_blocks": base["num_free_blocks"],
                 "leases": base["num_leases_active"]}]
        for i in range(1, a.drops + 1):
            ttft = drop_after_first_token(router, i, a.prompt_words)
            report = load(prefill)
            rows.append({"drops": i, "ttft_s": ttft, "free_blocks": report["num_free_blocks"],
                         "leases": report["num_leases_active"]})
        before = load(prefill)["num_computed_prompt_tokens"]
        result = probe(router, 20_000, a.prompt_words)
        result["prefill_computed_tokens"] = load(prefill)["num_computed_prompt_tokens"] - before
    finally:
        for process in reversed(processes):
            process.terminate()
        for process in processes:
            process.wait(timeout=30)
    print(f"prefill pool: {a.num_kv_blocks} blocks, prompts of ~{a.prompt_words} words, "
          f"lease {a.lease_seconds:.0f} s ({a.label})")
    print(f"{'drops':>5} {'its TTFT s':>10} {'free blocks':>11} {'leases held':>11}")
    for row in rows:
        ttft = "" if row["ttft_s"] is None else f"{row['ttft_s']:.2f}"
        print(f"{row['drops']:>5} {ttft:>10} {row['free_blocks']:>11} {row['leases']:>11}")
    print(f"then one ordinary request: {result}")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "pd_drop.json"
    saved = json.loads(out.read_text()) if out.exists() else {}
    saved[a.label] = {"args": vars(a), "rows": rows, "probe": result}
    out.write_text(json.dumps(saved, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

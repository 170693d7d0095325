"""What Ray costs: `hearth up --cluster` against plain `hearth up` on the same machine, one run.

Both serve the same stack (router + --prefill P + --decode D workers of the default model) and
replay the same real agent sessions (../shared/traces via hearth/bench/agent_replay.py, each
session's next turn after the previous answer, `x-session-affinity` set). The cluster is a real
multi-node Ray cluster on this machine (ray.cluster_utils.Cluster: a head with no CPUs for
workers and --nodes nodes on their own loopback addresses). Configurations alternate (plain,
cluster, plain, cluster, ...) --repeats times; each row reports min / median:

  start      seconds from launching `hearth up` to its router's /health answering 200
  wall       the replay's total time; later-turn TTFT p50 (every turn but a session's first)
  failed     requests that failed (must be 0)

Then, on the cluster stack, node loss: a long greedy stream and a sampled one run; the node of
the decode worker serving them is removed (raylet and every process on it killed); reported:
the longest pause between two chunks of each stream (the time from the loss to the stream
continuing on another worker: detection by the broken connection + the resume hop's re-prefill
of prompt + output so far), and the seconds until the deployment serves its targets again.

usage: flock /tmp/hearth-heavy.lock .venv/bin/python benchmarks/cluster.py [--repeats 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import model_of, stream_chat  # noqa: E402

from hearth.bench import agent_replay  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).parent / "results"
STORE = 80 * 2**20


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_stack(args, address: str | None, log_path: Path) -> tuple[subprocess.Popen, str, float]:
    port = free_port()
    argv = [sys.executable, "-m", "hearth.cli", "up", "--prefill", str(args.prefill),
            "--decode", str(args.decode), "--port", str(port),
            f"--worker-arg=--num-kv-blocks={args.kv_blocks}"]
    if address:
        argv += ["--cluster", address]
    start = time.perf_counter()
    log = open(log_path, "w")
    process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    log.close()
    url = f"http://127.0.0.1:{port}"
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"hearth up exited: {log_path.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return process, url, time.perf_counter() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.05)


def stop_stack(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=120)
    except subprocess.TimeoutExpired:
        process.kill()


async def replay(url: str, sessions) -> tuple[float, list[float], int, int]:
    model = await model_of(url, {})
    later, failed, done = [], 0, 0

    async def session(requests) -> None:
        nonlocal failed, done
        for request in requests:
            result = await stream_chat(url, model, [{"role": "user", "content": request.prompt}],
                                       request.max_tokens, {"x-session-affinity": request.session_id})
            done += 1
            if not result.ok:
                failed += 1
            elif request.index > 0:
                later.append(result.ttft)

    start = time.perf_counter()
    await asyncio.gather(*(session(s) for s in sessions))
    return time.perf_counter() - start, later, failed, done


def chunk_gaps(url: str, model: str, temperature: float, out: dict, key: str) -> None:
    """Stream a long answer; record the arrival time of each content chunk."""
    body = {"model": model, "max_tokens": 400, "temperature": temperature, "seed": 3,
            "ignore_eos": True, "stream": True,
            "messages": [{"role": "user", "content": "Tell a long story about a lighthouse."}]}
    times, errors = [], []
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as r:
            for line in r.iter_lines():
                if line.startswith("data: {") and '"content"' in line:
                    times.append(time.monotonic())
                if '"error"' in line:
                    errors.append(line[:300])
    except httpx.HTTPError as exc:
        errors.append(repr(exc))
    out[key] = (times, errors)


def node_loss(url: str, cluster) -> dict:
    model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    out: dict = {}
    threads = [threading.Thread(target=chunk_gaps, args=(url, model, t, out, k))
               for t, k in ((0.0, "greedy"), (1.0, "sampled"))]
    for t in threads:
        t.start()
    time.sleep(3.0)  # both decoding
    load = httpx.get(url + "/load", timeout=10).json()["endpoints"]
    busiest = max((e for e in load if e["role"] == "decode"), key=lambda e: e["own_requests"])
    health = httpx.get(url + "/health", timeout=10).json()["supervisor"]["workers"]
    prefix = next(w["node"] for w in health if w["name"] == busiest["name"])
    victim = next(n for n in cluster.worker_nodes if n.node_id.startswith(prefix))
    lost = time.monotonic()
    cluster.remove_node(victim, allow_graceful=False)
    for t in threads:
        t.join(timeout=600)
    row = {}
    for key, (times, errors) in out.items():
        after = [b - a for a, b in zip(times, times[1:]) if b > lost]
        row[key] = {"chunks": len(times), "errors": errors,
                    "max_gap_after_loss_s": max(after) if after else float("nan")}
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        workers = httpx.get(url + "/health", timeout=10).json()["supervisor"]["workers"]
        if sum(w["role"] == "decode" and w["state"] == "running" for w in workers) >= 2:
            row["replaced_after_s"] = time.monotonic() - lost
            break
        time.sleep(0.25)
    return row


def mm(values: list[float]) -> str:
    return f"{min(values):.2f} / {statistics.median(values):.2f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--traces", default=str(REPO.parent / "shared/traces"))
    p.add_argument("--sessions", type=int, default=4)
    p.add_argument("--requests", type=int, default=5, help="per session")
    p.add_argument("--prefill", type=int, default=1)
    p.add_argument("--decode", type=int, default=2)
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--kv-blocks", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=str(RESULTS / "cluster.json"))
    args = p.parse_args()

    from ray.cluster_utils import Cluster

    cfg = agent_replay.ReplayConfig(num_sessions=args.sessions, requests_per_session=args.requests,
                                    tokens_per_block=2)
    sessions = agent_replay.load_sessions(args.traces, cfg)
    logs = Path("/tmp/hearth-cluster-bench")
    logs.mkdir(exist_ok=True)
    cluster = Cluster(initialize_head=True, connect=False, head_node_args=dict(
        num_cpus=0, object_store_memory=STORE, include_dashboard=False))
    for i in range(args.nodes):
        cluster.add_node(num_cpus=4, object_store_memory=STORE, node_ip_address=f"127.0.0.{i + 2}")
    cluster.wait_for_nodes()
    rows: dict[str, dict[str, list]] = {"plain": {}, "cluster": {}}
    loss = {}
    try:
        for repeat in range(args.repeats):
            for name in ("plain", "cluster"):
                address = cluster.address if name == "cluster" else None
                process, url, start_s = start_stack(args, address, logs / f"{name}-{repeat}.log")
                try:
                    wall, later, failed, done = asyncio.run(replay(url, sessions))
                    if name == "cluster" and repeat == args.repeats - 1:
                        loss = node_loss(url, cluster)
                finally:
                    stop_stack(process)
                row = rows[name]
                for key, value in (("start_s", start_s), ("wall_s", wall),
                                   ("later_ttft_p50_s", statistics.median(later) if later else float("nan")),
                                   ("failed", failed), ("requests", done)):
                    row.setdefault(key, []).append(value)
                print(f"{name} #{repeat}: start {start_s:.2f}s wall {wall:.2f}s "
                      f"failed {failed}/{done}", flush=True)
    finally:
        cluster.shutdown()
    print(f"\n{cfg.describe()}; P={args.prefill} D={args.decode}; {args.nodes} Ray nodes; "
          f"min / median of {args.repeats}")
    print(f"{'':10}{'start s':>16}{'wall s':>16}{'later TTFT p50 s':>20}{'failed':>8}")
    for name, row in rows.items():
        print(f"{name:10}{mm(row['start_s']):>16}{mm(row['wall_s']):>16}"
              f"{mm(row['later_ttft_p50_s']):>20}{sum(row['failed']):>8}")
    plain, clus = rows["plain"], rows["cluster"]
    ratio = {k: statistics.median(clus[k]) / statistics.median(plain[k])
             for k in ("wall_s", "later_ttft_p50_s")}
    extra = statistics.median(clus["start_s"]) - statistics.median(plain["start_s"])
    print(f"cluster / plain (medians): wall {ratio['wall_s']:.3f}x, later TTFT "
          f"{ratio['later_ttft_p50_s']:.3f}x; start-up {extra:+.2f}s")
    print(f"node loss: {json.dumps(loss)}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"config": vars(args), "replay": cfg.describe(),
                                          "rows": rows, "ratios": ratio,
                                          "start_extra_s": extra, "node_loss": loss}, indent=1))


if __name__ == "__main__":
    main()

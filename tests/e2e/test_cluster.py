"""hearth on a real multi-node Ray cluster (issue 32): `hearth up --cluster`, `hearth scale`, node loss.

One Ray cluster for the module, from Ray's own `ray.cluster_utils.Cluster`: a head that hosts no
worker (0 CPUs: the deployment's registry and drivers only) and three nodes of 4 logical CPUs,
each with its own address (127.0.0.2-4), raylet and object store. One deployment on it, `hearth up --cluster` as a user
starts it (a real process, the router on a real port): P=1, D=2, and one monolithic worker with
TP=3 (its three ranks packed on one node; the default model's 9 heads / 3 KV heads allow T = 1
or 3, and PD roles need T = 1). Each test sets the targets it needs with `hearth scale
--wait` first, so the tests pass in any order. Only the first test keeps the TP=3 worker: its three
ranks on this 2-core machine wait at every collective for a descheduled rank (~200 ms a token,
where a one-rank worker takes ~10), and the router gives it its share of the requests, so the
later tests, which are about PD workers, scale it to 0. The Python API (`hearth.deploy`) and
the autoscaler get small deployments of their own, under other names, on the same cluster.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from tests.e2e.conftest import EXACT_FLAGS, MODEL, free_port

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from hearth.cluster.cluster_config import ClusterConfig  # noqa: E402

STORE = 80 * 2**20
# One compute thread per worker process (each rank of a TP / PP worker too): the nodes are this
# machine's few cores, shared by up to six workers and the test run; torch's default of a thread
# per core had each parallel region wait at its barrier for a thread another worker preempted.
THREADS = 1
ONE_THREAD = dict(threads_per_worker=THREADS)
SERVE_FLAGS = ("--num-kv-blocks=256", *EXACT_FLAGS)  # 4k tokens a worker: ample here
WORKER_ARGS = [f"--worker-arg={flag}" for flag in SERVE_FLAGS]
WORKER_KEY = "cluster-test-worker-key"  # so the tests can read each worker's own /load
# Bounded so that every text it admits fits the stream's max_tokens: sampled at temperature 1 the
# tiny model once wrote a 40th day of unbounded digits and hit the length limit (CI, 2026-12-06).
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}, "days": {
    "type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 31}, "maxItems": 10}},
    "required": ["city", "days"], "additionalProperties": False}


@dataclass
class Stack:
    process: subprocess.Popen
    url: str
    address: str
    log_path: Path

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0,
                             timeout=180)

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=10).json()

    def scale(self, **targets: int) -> dict:
        flags = [f"--{role}={n}" for role, n in targets.items()]
        done = subprocess.run(
            [sys.executable, "-m", "hearth.cli", "scale", "--cluster", self.address, *flags,
             "--wait", "--timeout", "240"], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:] + self.log_path.read_text()[-3000:]
        return json.loads(done.stdout)

    def log(self) -> str:
        return self.log_path.read_text()


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(initialize_head=True, connect=False, head_node_args=dict(
        num_cpus=0, object_store_memory=STORE, include_dashboard=False))
    # Each node on its own loopback address (its raylet, object store and hearth's HTTP and KV
    # servers bind there), the head on the machine's: the driver (`hearth up`) joins the head.
    for i in range(3):
        c.add_node(num_cpus=4, object_store_memory=STORE, node_ip_address=f"127.0.0.{i + 2}")
    c.wait_for_nodes()
    yield c
    c.shutdown()


@pytest.fixture(scope="module")
def stack(cluster, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("cluster") / "up.log"
    port = free_port()
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "hearth.cli", "up", "--cluster", cluster.address,
             "--prefill", "1", "--decode", "2", "--workers", "1", "--workers-tp", "3",
             "--port", str(port), "--show-worker-urls", "--threads-per-worker", str(THREADS),
             *WORKER_ARGS],
            stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "HEARTH_WORKER_API_KEY": WORKER_KEY})
    stack = Stack(process, f"http://127.0.0.1:{port}", cluster.address, log_path)
    deadline = time.monotonic() + 300
    while True:
        assert process.poll() is None, stack.log()[-5000:]
        try:
            if httpx.get(stack.url + "/health", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, stack.log()[-5000:]
        time.sleep(0.5)
    yield stack
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        process.wait(timeout=120)
    assert process.returncode == 0, stack.log()[-5000:]
    assert_nothing_left(cluster.address)


def assert_nothing_left(address: str, name: str | None = None) -> None:
    """No placement group, no live actor (of the deployment `name`, or of any) once it ended."""
    import ray._private.state as state
    from ray.util import placement_group_table

    def ours(actor_or_group_name: str | None) -> bool:
        return name is None or (actor_or_group_name or "").startswith(name + "-")

    ray.init(address=address, log_to_driver=False, namespace="hearth-test")
    try:
        deadline = time.monotonic() + 30
        while True:
            groups = {v.get("name"): v["state"] for v in placement_group_table().values()
                      if v["state"] != "REMOVED" and ours(v.get("name"))}
            actors = [a.get("Name") for a in state.actors().values()
                      if a["State"] != "DEAD" and ours(a.get("Name"))]
            if not groups and not actors:
                return
            assert time.monotonic() < deadline, (groups, actors)
            time.sleep(0.5)
    finally:
        ray.shutdown()


def worker_loads(stack: Stack) -> dict[str, dict]:
    """Each worker's own /load (with the KV pool check), by URL."""
    endpoints = httpx.get(stack.url + "/load", timeout=10).json()["endpoints"]
    return {e["url"]: httpx.get(e["url"] + "/load", params={"check_pool": "true"}, timeout=30,
                                headers={"Authorization": f"Bearer {WORKER_KEY}"}).json()
            for e in endpoints}


def wait_idle_and_whole(stack: Stack, num_workers: int, timeout: float = 60.0) -> dict:
    """Until the router knows `num_workers` workers and every one has nothing running or
    queued and its KV pool whole (bounded)."""
    deadline = time.monotonic() + timeout
    while True:
        loads = worker_loads(stack)
        if len(loads) == num_workers and all(r["num_requests_inflight"] == 0 and r["num_running"] == 0
               and r["num_waiting"] == 0 and r["kv_pool_is_whole"] is True
               for r in loads.values()):
            return loads
        assert time.monotonic() < deadline, loads
        time.sleep(0.5)


def workers(stack: Stack) -> list[dict]:
    return stack.health()["supervisor"]["workers"]


def test_deploys_and_answers_chat_responses_messages(stack):
    import anthropic

    stack.scale(prefill=1, decode=2, workers=1)
    views = workers(stack)
    assert sorted(w["role"] for w in views) == ["both", "decode", "decode", "prefill"]
    assert all(w["state"] == "running" for w in views)
    client = stack.client()
    chat = client.chat.completions.create(model=MODEL, max_tokens=12, temperature=0,
                                          messages=[{"role": "user", "content": "Say hello."}])
    assert chat.choices[0].message.content and chat.usage.completion_tokens == 12
    streamed = client.chat.completions.create(
        model=MODEL, max_tokens=12, temperature=0, stream=True,
        messages=[{"role": "user", "content": "Say hello."}])
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == \
        chat.choices[0].message.content
    response = client.responses.create(model=MODEL, input="Name a color.", max_output_tokens=10)
    assert response.status in ("completed", "incomplete") and response.output_text
    message = anthropic.Anthropic(base_url=stack.url, api_key="none", max_retries=0).messages.create(
        model=MODEL, max_tokens=10, messages=[{"role": "user", "content": "Name a fruit."}])
    assert message.content[0].text and message.usage.output_tokens == 10
    # the TP=3 monolithic worker is healthy beside the PD pools
    load = httpx.get(stack.url + "/load", timeout=10).json()
    assert {e["role"] for e in load["endpoints"]} == {"prefill", "decode", "both"}
    assert all(e["healthy"] for e in load["endpoints"])


class Load:
    """Streamed and plain chat requests from 3 threads until stopped; every failure recorded."""

    def __init__(self, make_client) -> None:
        self.make_client, self.done, self.failures = make_client, 0, []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(3)]

    def __enter__(self) -> "Load":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=300)

    def wait_done(self, more: int, timeout: float = 120.0) -> None:
        """Until `more` further requests have finished (a failure ends the wait: the test
        asserts there are none)."""
        want, deadline = self.done + more, time.monotonic() + timeout
        while self.done < want and not self.failures:
            assert time.monotonic() < deadline, (self.done, want)
            time.sleep(0.05)

    def _run(self, i: int) -> None:
        client = self.make_client()
        n = 0
        while not self._stop.is_set():
            n += 1
            messages = [{"role": "user", "content": f"Count to {n + i}, please."}]
            try:
                if n % 2:
                    chunks = client.chat.completions.create(
                        model=MODEL, max_tokens=16, messages=messages, stream=True,
                        extra_body={"ignore_eos": True})
                    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
                    assert reasons[-1] == "length", reasons
                else:
                    reply = client.chat.completions.create(
                        model=MODEL, max_tokens=16, messages=messages,
                        extra_body={"ignore_eos": True})
                    assert reply.usage.completion_tokens == 16
                self.done += 1
            except Exception as exc:  # noqa: BLE001 - every failure is the test's finding
                self.failures.append(repr(exc))


def test_scale_decode_2_3_1_under_load_loses_nothing(stack):
    stack.scale(decode=2, workers=0)
    with Load(stack.client) as load:
        load.wait_done(2)  # requests flow at 2 decode workers, ...
        status = stack.scale(decode=3)
        assert sum(w["role"] == "decode" for w in status["workers"]) == 3
        load.wait_done(2)  # ... at 3, ...
        status = stack.scale(decode=1)
        assert sum(w["role"] == "decode" for w in status["workers"]) == 1
        load.wait_done(2)  # ... and at 1 after the drain
    assert load.failures == [] and load.done >= 6, (load.failures, load.done)
    assert "draining worker" in stack.log()
    decode = [e for e in httpx.get(stack.url + "/load", timeout=10).json()["endpoints"]
              if e["role"] == "decode"]
    assert len(decode) == 1


def test_scale_refuses_bad_targets(stack):
    done = subprocess.run([sys.executable, "-m", "hearth.cli", "scale", "--cluster",
                           stack.address, "--decode", "0", "--workers", "0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "at least one decode" in done.stderr
    done = subprocess.run([sys.executable, "-m", "hearth.cli", "scale", "--cluster",
                           stack.address, "--cluster-name", "nope", "--decode", "1"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "no deployment named 'nope'" in done.stderr


def _stream(client: openai.OpenAI, kind: str, out: dict) -> None:
    messages = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]
    args: dict = dict(model=MODEL, messages=messages, max_tokens=160, stream=True)
    if kind == "greedy":
        args.update(temperature=0, extra_body={"ignore_eos": True})
    elif kind == "sampled":
        args.update(temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    else:
        messages[0]["content"] = "Plan a trip: give a city and a list of days as JSON."
        args.update(temperature=1.0, max_tokens=200, response_format={
            "type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA}})
    text, reasons, errors = [], [], []
    try:
        for chunk in client.chat.completions.create(**args):
            if chunk.choices:
                text.append(chunk.choices[0].delta.content or "")
                reasons.append(chunk.choices[0].finish_reason)
                out.setdefault(kind + "_started", time.monotonic())
    except Exception as exc:  # noqa: BLE001
        errors.append(repr(exc))
    out[kind] = ("".join(text), [r for r in reasons if r], errors)


def test_node_loss_mid_stream_streams_continue(stack, cluster):
    stack.scale(decode=2, workers=0)
    client = stack.client()
    reference = client.chat.completions.create(
        model=MODEL, max_tokens=160, temperature=0, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": "Write a long story about a lighthouse keeper."}])
    out: dict = {}
    threads = [threading.Thread(target=_stream, args=(client, kind, out))
               for kind in ("greedy", "sampled", "json")]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while not all(k + "_started" in out for k in ("greedy", "sampled", "json")):
        assert time.monotonic() < deadline and all(t.is_alive() for t in threads), out
        time.sleep(0.05)
    # the node of the decode worker with the most streams open (never the head: the registry)
    load = httpx.get(stack.url + "/load", timeout=10).json()["endpoints"]
    busiest = max((e for e in load if e["role"] == "decode"), key=lambda e: e["own_requests"])
    assert busiest["own_requests"] > 0
    node_prefix = next(w["node"] for w in workers(stack) if w["name"] == busiest["name"])
    victim = next(n for n in cluster.worker_nodes if n.node_id.startswith(node_prefix))
    lost = time.monotonic()
    cluster.remove_node(victim, allow_graceful=False)
    for t in threads:
        t.join(timeout=300)
    text, reasons, errors = out["greedy"]
    assert errors == [] and reasons == ["length"], out["greedy"]
    assert text == reference.choices[0].message.content  # one unbroken stream, exactly
    text, reasons, errors = out["sampled"]
    assert errors == [] and reasons == ["length"] and text, out["sampled"]
    text, reasons, errors = out["json"]
    assert errors == [] and reasons == ["stop"], out["json"]
    jsonschema.validate(json.loads(text), SCHEMA)
    # the lost worker is replaced on a node with room, and the deployment serves its targets
    status = stack.scale(decode=2)
    assert sum(w["role"] == "decode" and w["state"] == "running" for w in status["workers"]) == 2
    assert status["replaced"] >= 1
    assert "failed: its actor is gone" in stack.log() or "failed: its process exited" in stack.log()
    print(f"node loss -> targets served again after {time.monotonic() - lost:.1f}s")
    # what survived (and the replacement) holds no request, no queue, and every KV block
    wait_idle_and_whole(stack, num_workers=3)  # P=1, D=2
    cluster.add_node(num_cpus=4, object_store_memory=STORE,  # room for later tests
                     node_ip_address="127.0.0.5")


def api_client(deployment) -> openai.OpenAI:
    return openai.OpenAI(base_url=deployment.url + "/v1", api_key="none", max_retries=0,
                         timeout=180)


def running(status: dict, role: str) -> int:
    return sum(w["role"] == role and w["state"] == "running" for w in status["workers"])


def test_python_api_deploys_answers_scales_and_leaves_nothing(cluster):
    import hearth

    with hearth.deploy(model=MODEL, prefill=0, decode=1, address=cluster.address,
                       name="api-test", worker_args=SERVE_FLAGS,
                       cluster=ClusterConfig(**ONE_THREAD)) as deployment:
        assert ray.is_initialized()  # deploy() connected this process ...
        reply = api_client(deployment).chat.completions.create(
            model=MODEL, max_tokens=8, temperature=0, extra_body={"ignore_eos": True},
            messages=[{"role": "user", "content": "Say hello."}])
        assert reply.choices[0].message.content and reply.usage.completion_tokens == 8
        status = deployment.scale(decode=2, timeout=240)
        assert status["deployment"] == "api-test" and running(status, "decode") == 2
        status = deployment.scale(decode=1, timeout=240)
        assert running(status, "decode") == 1 and len(status["workers"]) == 1
        assert deployment.status()["targets"] == {"prefill": 0, "decode": 1, "both": 0}
        with pytest.raises(ValueError, match="at least one decode"):
            deployment.scale(decode=0)
    assert not ray.is_initialized()  # ... and shutdown() disconnected it
    assert deployment.exit_code == 0
    with pytest.raises(httpx.HTTPError):
        httpx.get(deployment.url + "/health", timeout=5)
    assert_nothing_left(cluster.address, "api-test")


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def router_routes_all(status: dict) -> bool:
    from hearth.cluster.commands import router_routes_all

    return router_routes_all(status)


def wait_for_status(deployment, ok, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        status = deployment.status()
        if ok(status):
            return status
        assert time.monotonic() < deadline, status
        time.sleep(0.25)


def test_autoscaler_follows_load_up_and_drains_back(cluster):
    import hearth

    lines = Lines()
    logging.getLogger("hearth.cluster").addHandler(lines)
    try:
        with hearth.deploy(model=MODEL, prefill=0, decode=1, address=cluster.address,
                           name="autoscale-test", worker_args=SERVE_FLAGS,
                           cluster=ClusterConfig(**ONE_THREAD),
                           autoscale={"decode": (1, 2)}, autoscale_target_requests=1,
                           autoscale_upscale_delay=1.0,
                           autoscale_downscale_delay=3.0) as deployment:
            with Load(lambda: api_client(deployment)) as load:  # 3 requests open, 1 wanted each
                wait_for_status(deployment, lambda s: s["targets"]["decode"] == 2, 120)
                wait_for_status(deployment, lambda s: running(s, "decode") == 2, 240)
                done_at_two = load.done
                deadline = time.monotonic() + 120
                while load.done < done_at_two + 3:  # the second worker takes part
                    assert time.monotonic() < deadline and not load.failures, load.failures
                    time.sleep(0.2)
            status = wait_for_status(deployment, lambda s: s["targets"]["decode"] == 1
                                     and len(s["workers"]) == 1
                                     and running(s, "decode") == 1, 120)
            assert load.failures == [], load.failures
            assert status["targets"]["decode"] == 1
    finally:
        logging.getLogger("hearth.cluster").removeHandler(lines)
    assert any("autoscale: decode workers 1 -> 2" in line for line in lines.lines), lines.lines
    assert any("autoscale: decode workers 2 -> 1" in line for line in lines.lines), lines.lines
    assert any("scale-down: draining worker" in line for line in lines.lines), lines.lines
    assert_nothing_left(cluster.address, "autoscale-test")


def test_prefill_on_a_node_that_joined_later_is_trusted_by_every_decode_worker(stack, cluster):
    """Every worker's KV peers file lists the cluster's alive nodes and is rewritten when a node
    joins: decode workers that started before the node trust a prefill worker placed on it at
    once (no restart), and the requests under load all succeed."""
    import ray._private.state as state
    from ray.util.placement_group import placement_group, remove_placement_group

    before = stack.scale(prefill=1, decode=2, workers=0)
    decode_before = sorted(w["name"] for w in before["workers"] if w["role"] == "decode")
    new_ip = "127.0.0.6"
    cluster.add_node(num_cpus=4, object_store_memory=STORE, node_ip_address=new_ip)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False, namespace="hearth-test")
    try:
        # fill every other node, so the next worker can only be placed on the new one
        blockers = []
        for node in ray.nodes():
            free = state.available_resources_per_node().get(node["NodeID"], {}).get("CPU", 0)
            if node["Alive"] and node["NodeManagerAddress"] != new_ip and free >= 1:
                group = placement_group([{"CPU": int(free),
                                          f"node:{node['NodeManagerAddress']}": 0.001}])
                assert group.wait(30), node
                blockers.append(group)
        with Load(stack.client) as load:
            status = stack.scale(prefill=2)
            load.wait_done(3)  # requests through both prefill workers (the load keeps going)
        for group in blockers:
            remove_placement_group(group)
    finally:
        ray.shutdown()
    assert load.failures == [] and load.done > 0, load.failures
    prefill_hosts = {w["host"] for w in status["workers"] if w["role"] == "prefill"}
    assert new_ip in prefill_hosts
    decode = [w for w in status["workers"] if w["role"] == "decode"]
    assert sorted(w["name"] for w in decode) == decode_before  # nobody was restarted
    assert all(w["state"] == "running" for w in decode)
    assert all(prefill_hosts <= set(w["kv_peers"]) for w in decode), status
    for worker in decode:  # what the worker itself reads
        entries = Path(worker["peers_file"]).read_text().split()
        assert new_ip in entries, (worker, entries)
        assert "not a trusted KV peer" not in Path(worker["log"]).read_text()
    stack.scale(prefill=1)


def test_pipeline_stages_on_two_nodes_answer_as_one_process_and_a_lost_stage_is_replaced(cluster):
    """A monolithic worker of P=2 pipeline stages, each on its own node (strict-spread): the
    two stages meet as a torchrun rank set would; its greedy tokens equal one process's; when
    the second stage's rank dies, the worker ends (its driver exits, not a server that only
    answers errors) and the controller replaces it."""
    import hearth
    from hearth.engine.llm import LLM, make_engine_config
    from hearth.engine.sampling_params import SamplingParams

    prompt = "The three primary colors are"
    llm = LLM(config=make_engine_config(MODEL))
    reference = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0,
                                                      ignore_eos=True))[0]
    llm.engine.close()
    engine = make_engine_config(MODEL, pipeline_parallel_size=2)
    with hearth.deploy(prefill=0, decode=0, workers=1, address=cluster.address,
                       name="pp-test", engine=engine,
                       cluster=ClusterConfig(stage_strategy="STRICT_SPREAD", **ONE_THREAD),
                       worker_args=SERVE_FLAGS) as deployment:
        (worker,) = deployment.status()["workers"]
        assert len(worker["stage_nodes"]) == 2 and len(set(worker["stage_nodes"])) == 2, worker
        reply = api_client(deployment).completions.create(
            model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
            extra_body={"ignore_eos": True})
        assert reply.choices[0].text == reference.text
        ranks = {int(k): v for k, v in worker["rank_pids"].items()}  # (msgpack/JSON keys)
        assert sorted(ranks) == [0, 1]
        os.kill(ranks[1], signal.SIGKILL)  # every node of this test cluster is this machine
        # running, and routed to by the router (its next discovery round + health check)
        status = wait_for_status(deployment, lambda s: [w["name"] for w in s["workers"]
                                                       if w["state"] == "running"]
                                 not in ([], [worker["name"]]) and router_routes_all(s),
                                 timeout=240)
        (new,) = [w for w in status["workers"] if w["state"] == "running"]
        assert new["name"] != worker["name"] and len(set(new["stage_nodes"])) == 2
        again = api_client(deployment).completions.create(
            model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
            extra_body={"ignore_eos": True})
        assert again.choices[0].text == reference.text
    assert_nothing_left(cluster.address, "pp-test")
    for pid in (*ranks.values(), *map(int, new["rank_pids"].values())):
        assert not Path(f"/proc/{pid}").exists() or "hearth.cli" not in Path(
            f"/proc/{pid}/cmdline").read_text(errors="replace"), pid  # every rank ended

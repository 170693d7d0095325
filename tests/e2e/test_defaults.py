"""`hearth serve` with nothing but a model and a port, as a user starts it: the formats it picks
for this machine (`--prefill-dtype auto`: bf16 many-row steps where AMX runs, else fp32;
`--kv-cache-dtype auto`: bf16 KV where hearth's CPU kernels run) and a
real request served through them, a prompt long enough to take the bf16 path, its blocks all
returned afterwards; and `hearth up`'s PD stack on its defaults (bf16 KV crossing from the
prefill worker to the decode worker). The other e2e tests pin the exact reference formats
(conftest.EXACT_FLAGS).
"""

from __future__ import annotations

import re

import pytest

import httpx

from hearth.engine.executor import amx_usable
from tests.e2e.conftest import MODEL, start_server, wait_for
from tests.e2e.test_up import CLIENT_KEY, environ, start_up, worker_pids, worker_url


@pytest.fixture(scope="module")
def default_server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("defaults"), exact=False)
    yield srv
    srv.stop()


def test_default_formats_follow_the_machine(default_server):
    log = default_server.log_path.read_text()
    found = re.search(r"formats: weights (\S+) \(decode: (\S+), prefill: (\S+)\), "
                      r"KV cache (\S+), CPU kernels (\S+)", log)
    assert found, log[-3000:]
    weights, _, prefill, kv, kernels = found.groups()
    assert weights == "float32"
    assert prefill == ("bfloat16" if amx_usable() else "float32"), log[-3000:]
    assert kv == ("float32" if kernels == "off" else "bfloat16"), log[-3000:]


def test_default_server_answers_a_long_prompt_and_frees_its_blocks(default_server):
    client = default_server.client()
    facts = " ".join(f"Fact {i}: the depot on street {i} opens at {i % 12 + 1} o'clock."
                     for i in range(40))
    reply = client.chat.completions.create(
        model="smollm2-135m-instruct", max_tokens=12, temperature=0,
        messages=[{"role": "user", "content": facts + " When does the depot on street 7 open?"}])
    assert reply.usage.prompt_tokens > 400  # one many-row prefill step
    assert reply.choices[0].message.content.strip()
    assert reply.usage.completion_tokens >= 1
    report = default_server.wait_idle_and_whole()
    assert report["num_requests_inflight"] == 0 and report["num_waiting"] == 0
    assert report["kv_pool_is_whole"] is True


def test_default_pd_stack_moves_bf16_kv_and_frees_everything(tmp_path):
    stack = start_up(tmp_path, MODEL, "--prefill", "1", "--decode", "1", "--num-kv-blocks", "256",
                     env={"HEARTH_API_KEY": CLIENT_KEY}, exact=False)
    try:
        workers = {}
        for role in ("prefill", "decode"):
            [pid] = worker_pids(stack, role)
            workers[role] = (worker_url(pid),
                             {"Authorization": f"Bearer {environ(pid)['HEARTH_API_KEY']}"})

        def load(role):
            url, headers = workers[role]
            return httpx.get(url + "/load", params={"check_pool": "true"}, headers=headers,
                             timeout=30).json()

        before = load("decode")["num_transferred_tokens"]
        facts = " ".join(f"Note {i}: crate {i} holds {i * 3} apples." for i in range(60))
        body = {"model": MODEL, "max_tokens": 10, "temperature": 0,
                "messages": [{"role": "user", "content": facts + " How many apples in crate 9?"}]}
        r = httpx.post(stack.url + "/v1/chat/completions", json=body, timeout=120,
                       headers={"Authorization": f"Bearer {CLIENT_KEY}"})
        assert r.status_code == 200, r.text
        reply = r.json()
        assert reply["usage"]["prompt_tokens"] > 400 and reply["choices"][0]["message"]["content"]
        assert load("decode")["num_transferred_tokens"] - before >= 400  # it crossed as KV
        for role in workers:
            wait_for(lambda: load(role)["num_requests_inflight"] == 0
                     and load(role)["kv_pool_is_whole"] is True,
                     f"{role} idle, pool whole", stack.log_path, 60)
        logs = "".join(p.read_text() for p in tmp_path.rglob("*.log"))  # the stack's and workers'
        kv = re.findall(r"KV cache (\S+), CPU kernels (\S+)", logs)
        assert len(kv) >= 2 and all(d == ("float32" if k == "off" else "bfloat16") for d, k in kv), kv
    finally:
        stack.stop()

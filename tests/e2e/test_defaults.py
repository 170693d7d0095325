"""`hearth serve` with nothing but a model and a port, as a user starts it: the formats it picks
for this machine (`--prefill-dtype auto`: bf16 many-row steps where AMX runs, else fp32;
`--kv-cache-dtype auto`: bf16 KV where hearth's CPU kernels run) and a
real request served through them, a prompt long enough to take the bf16 path, its blocks all
returned afterwards. The other e2e tests pin the exact reference format (conftest.EXACT_FLAGS).
"""

from __future__ import annotations

import re

import pytest

from hearth.engine.executor import amx_usable
from tests.e2e.conftest import start_server


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

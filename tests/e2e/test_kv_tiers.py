"""Two real workers sharing one KV-tier directory, through the official openai client.

Worker 1 computes a long prompt, then a second prompt pushes it out of its small pool, so its
blocks are written to the shared directory. Worker 2, which never saw the prompt, then serves it
with the prompt's blocks loaded from the directory: `cached_tokens` counts them, the greedy text
equals worker 1's, /metrics shows the shared tier's hits, /load reports the tier's stored blocks
for the router, and both pools are whole afterwards.
"""

from __future__ import annotations

import re
import time

import httpx

from tests.e2e.conftest import MODEL, start_servers

BLOCK = 16
PROMPT = " ".join(f"step {i}: the agent reads file_{i}.py and runs its tests." for i in range(30))
OTHER = " ".join(f"note {i}: an unrelated session about topic {i * 7}." for i in range(36))


def complete(server, prompt: str):
    return server.client().completions.create(model=MODEL, prompt=prompt, max_tokens=8,
                                              temperature=0.0)


def metric(server, name: str, tier: str | None = None) -> float:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    label = f',tier="{tier}"' if tier else ""
    m = re.search(rf'^hearth:{name}{{model_name="[^"]+"{label}}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else float("nan")


def test_a_worker_loads_what_another_worker_offloaded(tmp_path):
    shared = ("--kv-offload-dir", str(tmp_path / "kv"), "--kv-offload-shared",
              "--num-kv-blocks", "40")
    w1, w2 = start_servers(tmp_path, shared, shared)
    try:
        first = complete(w1, PROMPT)
        num_prompt = first.usage.prompt_tokens
        assert num_prompt > 24 * BLOCK  # most of the 40-block pool
        complete(w1, OTHER)  # evicts PROMPT's blocks from w1's pool into the directory
        w1.wait_idle_and_whole()
        deadline = time.monotonic() + 30
        while metric(w1, "kv_offload_queue_depth") > 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert metric(w1, "kv_tier_stored_blocks", "shared") > 0
        events = httpx.get(w1.url + "/load", params={"events_since": 0}, timeout=30).json()
        assert events["block_events"]["tiers"]["shared"]["stored"]

        second = complete(w2, PROMPT)  # w2 never computed it
        assert second.choices[0].text == first.choices[0].text
        cached = second.usage.prompt_tokens_details.cached_tokens
        assert cached >= 20 * BLOCK, second.usage  # loaded from the shared tier
        assert metric(w2, "kv_tier_hit_blocks", "shared") == cached // BLOCK
        assert metric(w2, "kv_offload_loaded_tokens") == cached
        for w in (w1, w2):
            assert w.wait_idle_and_whole()["kv_pool_is_whole"] is True
    finally:
        for w in (w1, w2):
            w.stop()

"""A Mixture-of-Experts model served for real: a worker answers through the official client and
counts the tokens routed to each expert on /metrics exactly; `hearth up` moves its KV from a
prefill worker to a decode worker and answers what the monolithic worker answers."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from hearth.models.random_checkpoint import write_random_checkpoint
from tests.e2e.conftest import start_server
from tests.e2e.test_up import PROMPT, start_up

NUM_LAYERS, TOP_K = 2, 2
COUNT_LINE = re.compile(r'^hearth:moe_expert_tokens_total\{(?P<labels>[^}]*)\} (?P<value>\S+)$')


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> str:
    return str(write_random_checkpoint(tmp_path_factory.mktemp("moe") / "tiny-moe",
                                       num_layers=NUM_LAYERS, num_experts=8,
                                       num_experts_per_tok=TOP_K, expert_intermediate_size=32))


def expert_tokens(url: str) -> dict[int, float]:
    """Tokens routed per MoE layer (summed over its experts) from /metrics."""
    totals: dict[int, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        match = COUNT_LINE.match(line)
        if match:
            layer = int(re.search(r'layer="(\d+)"', match["labels"])[1])
            totals[layer] = totals.get(layer, 0.0) + float(match["value"])
    return totals


def test_moe_worker_answers_and_counts_routed_tokens_exactly(tmp_path: Path, moe: str):
    server = start_server(tmp_path, "--model", moe)
    try:
        client, name = server.client(), Path(moe).name
        before = expert_tokens(server.url)
        out = client.completions.create(model=name, prompt=PROMPT, max_tokens=6, temperature=0,
                                        extra_body={"ignore_eos": True})
        streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
            model=name, prompt=PROMPT, max_tokens=6, temperature=0, stream=True,
            extra_body={"ignore_eos": True}) if chunk.choices)
        assert out.usage.completion_tokens == 6 and streamed == out.choices[0].text
        server.wait_idle_and_whole()
        after = expert_tokens(server.url)
        # Every token run through the model picks TOP_K experts in every layer: the first
        # request's prompt and 5 decodes (its last token is never run), the second's uncached
        # prompt tail and 5 decodes.
        first = out.usage.prompt_tokens + 5
        second = out.usage.prompt_tokens - 32 + 5  # two 16-token blocks hit the prefix cache
        for layer in range(NUM_LAYERS):
            assert after[layer] - before.get(layer, 0) == TOP_K * (first + second)
    finally:
        server.stop()


def test_moe_prefill_decode_stack_answers_as_one_worker(tmp_path: Path, moe: str):
    worker = start_server(tmp_path, "--model", moe)
    try:
        want = worker.client().completions.create(model=Path(moe).name, prompt=PROMPT,
                                                  max_tokens=8, temperature=0,
                                                  extra_body={"ignore_eos": True})
    finally:
        worker.stop()
    stack = start_up(tmp_path, moe, "--prefill", "1", "--decode", "1")
    try:
        got = stack.client().completions.create(model=stack.model, prompt=PROMPT, max_tokens=8,
                                                temperature=0, extra_body={"ignore_eos": True})
        assert got.choices[0].text == want.choices[0].text
        assert got.usage.completion_tokens == 8
    finally:
        stack.stop()

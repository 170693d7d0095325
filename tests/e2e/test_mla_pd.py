"""Prefill/decode disaggregation of a latent-cache (MLA) model between real worker processes.

A tiny random DeepSeek-V3 (written here) is served three times: a prefill worker, a decode
worker and a monolithic worker, all in the exact formats. The two hops are sent by hand over
HTTP (as the router would), so the test sees the descriptor and the decode side's transfer
counters: the text equals the monolithic worker's, the bytes moved are the latent blocks'
(`blocks * bytes_per_block` of `[layers, 1, block_size, 1, kv_lora_rank + rope]`), a forged
descriptor of the two-plane K/V layout is a 400 that leaves the lease usable, and both pools
end whole with no lease left. `hearth up` with a router answers as the monolithic worker too.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from hearth.engine.kv.cache import cdiv
from hearth.models.hf_loader import HFCheckpoint
from hearth.models.random_checkpoint import write_random_deepseek
from tests.e2e.conftest import start_servers, stop_all
from tests.e2e.test_up import PROMPT, start_up

SECRET = "mla-pd-secret"
BLOCK = 16
FLAGS = ("--num-kv-blocks", "64", "--max-num-seqs", "4", "--kv-secret", SECRET)
PROMPTS = [PROMPT, " ".join(f"t{(7 * i) % 200 + 3}" for i in range(70)), "t9 t8 t7"]


@pytest.fixture(scope="module")
def tiny_deepseek(tmp_path_factory) -> str:
    return str(write_random_deepseek(tmp_path_factory.mktemp("mla-e2e") / "tiny-ds"))


@pytest.fixture(scope="module")
def workers(tmp_path_factory, tiny_deepseek):
    """(prefill, decode, monolithic) workers of the tiny DeepSeek."""
    tmp = tmp_path_factory.mktemp("mla-pd")
    model = ("--model", tiny_deepseek)
    servers = start_servers(tmp, (*model, "--role", "prefill", *FLAGS),
                            (*model, "--role", "decode", *FLAGS), (*model, *FLAGS))
    yield servers
    stop_all(*servers)


def body(model: str, prompt: str, max_tokens: int, **extra) -> dict:
    return dict(model=Path(model).name, prompt=prompt, max_tokens=max_tokens, temperature=0,
                ignore_eos=True, **extra)


def post(server, payload: dict) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", json=payload, timeout=120)


def prefill_hop(server, model: str, prompt: str, transfer_id: str) -> dict:
    response = post(server, body(model, prompt, 1, kv_transfer={"role": "prefill",
                                                              "transfer_id": transfer_id}))
    assert response.status_code == 200, response.text
    return response.json()


def decode_hop(server, model: str, prompt: str, kv: dict, max_tokens: int,
               descriptor: dict | None = None) -> httpx.Response:
    return post(server, body(model, prompt, max_tokens, kv_transfer={
        "role": "decode", "prompt_token_ids": kv["prompt_token_ids"],
        "first_token_id": kv["first_token_id"], "descriptor": descriptor or kv["descriptor"]}))


def latent_and_expanded_bytes_per_block(model: str) -> tuple[int, int]:
    """Float32 bytes of one block: the latent layout the cache uses, and the K/V layout MLA
    would cache without it (K of qk_head_dim and V of v_head_dim for each head)."""
    arch = HFCheckpoint(Path(model)).arch
    latent = arch.num_layers * BLOCK * arch.mla.latent_dim * 4
    expanded = (arch.num_layers * BLOCK * arch.num_heads
                * (arch.mla.qk_head_dim + arch.mla.v_head_dim) * 4)
    return latent, expanded


def assert_whole_and_no_lease(prefill, decode) -> None:
    for server in (prefill, decode):
        report = server.wait_idle_and_whole()
        assert report["kv_pool_is_whole"] is True, (server.url, report)
    assert prefill.load()["num_leases_active"] == 0


def test_pd_hops_equal_monolithic_and_move_the_latent_blocks(workers, tiny_deepseek):
    prefill, decode, mono = workers
    latent, expanded = latent_and_expanded_bytes_per_block(tiny_deepseek)
    assert expanded == 4 * latent  # 4 heads x (24 + 16) against 32 + 8 per token and layer
    before = decode.load()
    total_blocks = 0
    for i, prompt in enumerate(PROMPTS):
        want = post(mono, body(tiny_deepseek, prompt, 12)).json()
        first = prefill_hop(prefill, tiny_deepseek, prompt, f"mla-{i}")
        kv = first["kv_transfer"]
        d = kv["descriptor"]
        assert (d["num_planes"], d["num_kv_heads"], d["bytes_per_block"]) == (1, 1, latent)
        response = decode_hop(decode, tiny_deepseek, prompt, kv, 12)
        assert response.status_code == 200, response.text
        got = response.json()
        text = first["choices"][0]["text"] + got["choices"][0]["text"]
        assert text == want["choices"][0]["text"], prompt
        assert got["usage"]["completion_tokens"] == 12
        num_blocks = cdiv(want["usage"]["prompt_tokens"], BLOCK)
        assert got["kv_transfer"]["num_transferred_blocks"] == num_blocks
        assert got["kv_transfer"]["num_transferred_bytes"] == num_blocks * latent
        total_blocks += num_blocks
    after = decode.load()
    assert after["num_computed_prompt_tokens"] == before["num_computed_prompt_tokens"]
    assert after["num_transferred_bytes"] - before["num_transferred_bytes"] == total_blocks * latent
    assert after["num_kv_transfer_failures"] == before["num_kv_transfer_failures"]
    assert_whole_and_no_lease(prefill, decode)


def test_a_descriptor_of_the_two_plane_layout_is_a_400_and_leaks_nothing(workers, tiny_deepseek):
    prefill, decode, mono = workers
    prompt = " ".join(f"t{(13 * i) % 200 + 3}" for i in range(50))  # no other test's prompt
    kv = prefill_hop(prefill, tiny_deepseek, prompt, "mla-forged")["kv_transfer"]
    d = kv["descriptor"]
    forged = [dict(d, num_planes=2, head_dim=d["head_dim"] // 2),  # same bytes per block
              dict(d, num_planes=2, bytes_per_block=2 * d["bytes_per_block"])]
    for descriptor in forged:
        response = decode_hop(decode, tiny_deepseek, prompt, kv, 6, descriptor)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert "KV layout" in error["message"] and "kv_transfer" in error["param"]
    assert decode.wait_idle_and_whole()["kv_pool_is_whole"] is True
    assert prefill.load()["num_leases_active"] == 1  # the refusals never touched the lease
    # the real descriptor still works: the pull acknowledges and ends the lease
    response = decode_hop(decode, tiny_deepseek, prompt, kv, 6)
    assert response.status_code == 200, response.text
    assert response.json()["kv_transfer"]["num_transferred_blocks"] == cdiv(
        len(kv["prompt_token_ids"]), BLOCK)
    assert_whole_and_no_lease(prefill, decode)


def test_hearth_up_prefill_decode_stack_answers_as_the_monolithic_worker(workers, tiny_deepseek,
                                                                         tmp_path):
    mono = workers[2]
    want = post(mono, body(tiny_deepseek, PROMPT, 8)).json()["choices"][0]["text"]
    stack = start_up(tmp_path, tiny_deepseek, "--prefill", "1", "--decode", "1")
    try:
        got = stack.client().completions.create(model=stack.model, prompt=PROMPT, max_tokens=8,
                                                temperature=0, extra_body={"ignore_eos": True})
        assert got.choices[0].text == want and got.usage.completion_tokens == 8
    finally:
        stack.stop()

"""Prefill/decode disaggregation over MLA's latent KV cache, two real engines on loopback TCP.

A tiny random DeepSeek-V3 keeps one latent row (kv_lora_rank + qk_rope_head_dim values) per
token and layer: KV tensor `[layers, 1, blocks, block_size, 1, latent_dim]`. The prefill engine
exports it, the decode engine pulls it and continues: greedy output equals the monolithic
engine's, the decode side computes no prompt token, and exactly `blocks * bytes_per_block` of the
latent layout cross the wire (a quarter of what the expanded K/V of every head would be here).
A descriptor of another layout (a forged two-plane one, a dense model's, or the latent one on a
dense worker) is refused at `add_request`, and both pools end whole with no lease left.
"""

from __future__ import annotations

from dataclasses import replace

import msgspec
import pytest

from hearth.config import KVTransferConfig
from hearth.kv_transfer.connector import DisaggConnector
from hearth.kv_transfer.tcp_transport import TransferClient
from hearth.engine.kv.transfer_api import ITEMSIZE, KVTransfer
from hearth.engine.engine import LLMEngine
from hearth.engine.kv.cache import cdiv
from hearth.engine.llm import make_engine_config
from hearth.models.random_checkpoint import write_random_checkpoint, write_random_deepseek
from tests.model.test_kv_transfer import FakeClock, decode_all, greedy, prefill_all, run
from tests.model.test_moe import EXACT, PROMPTS

SECRET = "test-secret"
BLOCK = 16
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def tiny_deepseek(tmp_path_factory) -> str:
    return str(write_random_deepseek(tmp_path_factory.mktemp("mla-pd") / "ds"))


@pytest.fixture(scope="module")
def tiny_dense(tmp_path_factory) -> str:
    """A dense (Llama-layout) model of the same vocabulary and word tokenizer."""
    return str(write_random_checkpoint(tmp_path_factory.mktemp("mla-pd") / "dense",
                                       num_layers=2))


def make_engine(model: str, role: str, clock=None) -> LLMEngine:
    config = make_engine_config(model, **EXACT, num_blocks=64)
    if role == "both":
        return LLMEngine(config)
    config = replace(config, kv_transfer=KVTransferConfig(role=role, secret=SECRET,
                                                          lease_seconds=30))

    def factory(cfg, kv_cache, geometry):
        return DisaggConnector(cfg, kv_cache, geometry, clock=clock or FakeClock())
    return LLMEngine(config, connector_factory=factory)


@pytest.fixture(scope="module")
def pd(tiny_deepseek):
    """(prefill engine, decode engine) of the tiny DeepSeek."""
    prefill, decode = make_engine(tiny_deepseek, "prefill"), make_engine(tiny_deepseek, "decode")
    yield prefill, decode
    prefill.close()
    decode.close()


@pytest.fixture
def fresh(pd):
    for engine in pd:
        assert engine.kv_pool_is_whole()
        engine.pool.reset_cache()
    return pd


@pytest.fixture(scope="module")
def monolithic(tiny_deepseek) -> dict[str, list[int]]:
    """Greedy tokens of one engine without disaggregation, per prompt."""
    engine = make_engine(tiny_deepseek, "both")
    try:
        for i, ids in enumerate(PROMPTS):
            engine.add_request(f"m{i}", ids, greedy(MAX_TOKENS))
        outs = run(engine)
        assert engine.kv_pool_is_whole()
    finally:
        engine.close()
    return {rid: [t for o in chunks for t in o.new_token_ids] for rid, chunks in outs.items()}


def expanded_bytes_per_block(arch, itemsize: int) -> int:
    """One block of the K/V MLA would cache without the latent: K of qk_head_dim and V of
    v_head_dim for every head, in every layer."""
    mla = arch.mla
    return arch.num_layers * BLOCK * arch.num_heads * (mla.qk_head_dim + mla.v_head_dim) * itemsize


def test_pd_over_the_latent_cache_equals_monolithic_and_moves_latent_bytes(fresh, monolithic):
    prefill, decode = fresh
    arch = decode.arch
    assert tuple(decode.executor.kv_cache.shape) == (
        arch.num_layers, 1, 64, BLOCK, 1, arch.mla.kv_lora_rank + arch.mla.qk_rope_head_dim)
    prompts = {f"m{i}": ids for i, ids in enumerate(PROMPTS)}
    before = decode.stats()
    firsts = prefill_all(prefill, prompts)
    d = firsts["m0"].kv_descriptor
    latent = arch.num_layers * BLOCK * arch.mla.latent_dim * ITEMSIZE["float32"]
    assert (d.num_planes, d.num_kv_heads, d.head_dim) == (1, 1, arch.mla.latent_dim)
    assert d.bytes_per_block == latent
    assert expanded_bytes_per_block(arch, 4) / latent == 4.0  # 4 x (24 + 16) vs 32 + 8
    results = decode_all(decode, prompts, firsts, MAX_TOKENS)
    after = decode.stats()
    for rid, ids in prompts.items():
        tokens, final = results[rid]
        assert tokens == monolithic[rid], rid
        assert final.num_transferred_tokens == len(ids)
        assert final.num_transferred_blocks == cdiv(len(ids), BLOCK)
        assert final.num_transferred_bytes == cdiv(len(ids), BLOCK) * latent
    num_blocks = sum(cdiv(len(ids), BLOCK) for ids in prompts.values())
    assert after.num_computed_prompt_tokens == before.num_computed_prompt_tokens
    assert after.num_transferred_bytes - before.num_transferred_bytes == num_blocks * latent
    assert after.num_kv_transfer_failures == before.num_kv_transfer_failures
    assert prefill.stats().num_leases_active == 0
    assert prefill.kv_pool_is_whole() and decode.kv_pool_is_whole()


def test_next_turn_pulls_only_the_latent_blocks_the_decode_side_lacks(fresh, monolithic):
    prefill, decode = fresh
    ids = PROMPTS[4]  # 47 tokens: 2 full blocks and a partial one
    firsts = prefill_all(prefill, {"a": ids})
    decode_all(decode, {"a": ids}, firsts, MAX_TOKENS)
    firsts = prefill_all(prefill, {"b": ids})
    (tokens, final), = decode_all(decode, {"b": ids}, firsts, MAX_TOKENS).values()
    assert tokens == monolithic["m4"]
    assert final.num_cached_tokens == 2 * BLOCK and final.num_transferred_blocks == 1
    assert final.num_transferred_bytes == firsts["b"].kv_descriptor.bytes_per_block
    assert prefill.stats().num_leases_active == 0
    assert prefill.kv_pool_is_whole() and decode.kv_pool_is_whole()


def refuse(decode: LLMEngine, rid: str, ids: list[int], descriptor, first_token_id: int) -> None:
    spec = KVTransfer("decode", descriptor=descriptor, first_token_id=first_token_id)
    before = decode.stats().num_transferred_blocks
    with pytest.raises(ValueError, match="KV layout") as info:
        decode.add_request(rid, ids, greedy(4), spec)
    assert "differs from this worker's" in str(info.value)
    assert not decode.has_unfinished() and decode.stats().num_transferred_blocks == before
    assert decode.kv_pool_is_whole()


def reject_lease(descriptor) -> None:
    """What the server does for a refused decode hop's lease: nothing; here the lease is ended
    by hand so the pool's wholeness is checked now rather than after lease expiry."""
    client = TransferClient(SECRET)
    with client.connect(descriptor.host, descriptor.port, descriptor.transfer_id) as sock:
        client.finish(sock, descriptor.transfer_id, ack=False)


def test_a_two_plane_descriptor_is_refused_by_the_latent_worker(fresh):
    """The same bytes per block relabelled as K and V planes (num_planes 2, half the dim) or
    the latent's planes with the expanded size: either way another layout, refused."""
    prefill, decode = fresh
    ids = PROMPTS[3]
    firsts = prefill_all(prefill, {"f": ids})
    d = firsts["f"].kv_descriptor
    first = firsts["f"].new_token_ids[0]
    half = d.head_dim // 2
    forged = [msgspec.structs.replace(d, num_planes=2, head_dim=half),  # same bytes, 2 planes
              msgspec.structs.replace(d, num_planes=2, bytes_per_block=2 * d.bytes_per_block)]
    for descriptor in forged:
        refuse(decode, "f", ids, descriptor, first)
    assert prefill.stats().num_leases_active == 1  # refused before any connection was made
    reject_lease(d)
    assert prefill.stats().num_leases_active == 0 and prefill.kv_pool_is_whole()


@pytest.mark.parametrize("direction", ["dense_to_latent", "latent_to_dense"])
def test_descriptors_cross_between_dense_and_latent_workers_are_refused(fresh, tiny_dense,
                                                                        direction):
    """Same tokenizer, same prompt, same block size: only the KV layout differs."""
    prefill, decode = fresh
    dense = make_engine(tiny_dense, "decode" if direction == "latent_to_dense" else "prefill")
    try:
        src, dst = (dense, decode) if direction == "dense_to_latent" else (prefill, dense)
        ids = PROMPTS[4]
        firsts = prefill_all(src, {"x": ids})
        d = firsts["x"].kv_descriptor
        assert d.num_planes == (2 if src is dense else 1)
        refuse(dst, "x", ids, d, firsts["x"].new_token_ids[0])
        assert src.stats().num_leases_active == 1
        reject_lease(d)
        assert src.stats().num_leases_active == 0
        assert src.kv_pool_is_whole() and dst.kv_pool_is_whole()
    finally:
        dense.close()

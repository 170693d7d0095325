"""KV tiers below the pool over MLA's latent cache (a tiny random DeepSeek-V3).

A latent block is `[layers, 1, block_size, 1, kv_lora_rank + qk_rope_head_dim]`: records are
written, checked and loaded back in that shape. As in test_kv_tiers_engine.py, a small pool
cannot hold two long prompts, so the second evicts the first into the tier and the first's next
run loads it back instead of recomputing: greedy output is identical to a tier-less engine's,
the loaded tokens count as cached, and every pool is whole after every request. Each tier kind
runs: the disk directory, a host-memory tier above it, a directory shared by two engines (the
second loads what the first wrote through), and Mooncake Store against a local master.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from hearth.config import KVOffloadConfig
from hearth.kv_tiers.block_file import record_bytes
from hearth.kv_tiers.store import make_store
from hearth.kv_tiers.mooncake_store import mooncake_available
from hearth.engine.kv.transfer_api import KVCacheGeometry
from hearth.engine.engine import LLMEngine
from hearth.engine.kv.tiers import store_namespace
from hearth.engine.llm import make_engine_config
from hearth.models.random_checkpoint import write_random_deepseek
from tests.e2e.test_kv_tiers_mooncake import master  # noqa: F401 (a fixture: a local master)
from tests.model.test_kv_tiers_engine import run_one, wait_for_writes
from tests.model.test_moe import EXACT

BLOCK = 16
NUM_BLOCKS = 20  # 320 tokens: one ~200-token prompt evicts most of another
A = [(7 * i) % 250 + 3 for i in range(169)]
B = [(11 * i + 5) % 250 + 3 for i in range(203)]
SEQUENCE = (("a1", A), ("b1", B), ("a2", A), ("b2", B))


@pytest.fixture(scope="module")
def tiny_deepseek(tmp_path_factory) -> str:
    return str(write_random_deepseek(tmp_path_factory.mktemp("mla-tiers") / "ds"))


def make_engine(model: str, offload: KVOffloadConfig | None) -> LLMEngine:
    config = make_engine_config(model, **EXACT, num_blocks=NUM_BLOCKS)
    if offload is None:
        return LLMEngine(config)
    return LLMEngine(replace(config, kv_offload=offload), store_factory=make_store)


@pytest.fixture(scope="module")
def reference(tiny_deepseek) -> dict:
    """request id -> (tokens, cached tokens) of the tier-less engine over SEQUENCE."""
    engine = make_engine(tiny_deepseek, None)
    try:
        return {rid: run_one(engine, rid, ids) for rid, ids in SEQUENCE}
    finally:
        engine.close()


def check_latent_records(engine: LLMEngine, directory: Path) -> None:
    """Every record on disk is one latent block (header + layers * block_size * latent_dim
    floats), under a namespace of the latent layout."""
    kv = engine.executor.kv_cache
    geometry = KVCacheGeometry.of(kv, BLOCK)
    assert (geometry.num_planes, geometry.num_kv_heads) == (1, 1)
    namespace = store_namespace(engine.config.model, geometry)
    files = list((directory / namespace).rglob("*.kvb"))
    assert files
    latent = engine.arch.num_layers * BLOCK * engine.arch.mla.latent_dim * 4
    assert {f.stat().st_size for f in files} == {record_bytes(geometry)} == {68 + latent}


@pytest.mark.parametrize("host_gb", [0.0, 0.001], ids=["disk", "host+disk"])
def test_evicted_latent_blocks_load_back_with_identical_output(tiny_deepseek, reference,
                                                               tmp_path, host_gb):
    engine = make_engine(tiny_deepseek, KVOffloadConfig(directory=str(tmp_path / "kv"),
                                                        host_gb=host_gb))
    try:
        got = {rid: run_one(engine, rid, ids) for rid, ids in SEQUENCE}
        for rid in got:
            assert got[rid][0] == reference[rid][0], rid
        # b1 evicted a1's blocks: without tiers a2 recomputes most of A, with them it loads
        full_blocks = (len(A) - 1) // BLOCK
        assert reference["a2"][1] < full_blocks * BLOCK
        assert got["a2"][1] == full_blocks * BLOCK
        stats = engine.stats().kv_tiers
        # a2's tier blocks arrive by a load, or by a fill when the read-ahead finished while
        # a2 still waited (a race with the store's reader thread): either way, none failed
        offload = stats["offload"]
        assert offload["load_failures"] == 0 and offload["loads"] + offload["fills"] >= 1
        hits = sum(stats[t]["hits"] for t in ("host", "disk") if t in stats)
        assert hits > 0 and offload["load_blocks"] == hits
        assert all(stats[t]["corrupt"] == 0 for t in ("host", "disk") if t in stats)
        engine.pool.reset_cache()  # everything cached goes down to the tiers
        wait_for_writes(engine)
        if host_gb == 0.0:
            check_latent_records(engine, tmp_path / "kv")
        assert engine.kv_pool_is_whole()
    finally:
        engine.close()


def test_a_second_engine_loads_latent_blocks_written_through_to_a_shared_dir(tiny_deepseek,
                                                                             reference,
                                                                             tmp_path):
    shared = KVOffloadConfig(directory=str(tmp_path / "kv"), shared=True)
    first, second = make_engine(tiny_deepseek, shared), make_engine(tiny_deepseek, shared)
    try:
        tokens, _ = run_one(first, "a1", A)  # written through as computed
        assert tokens == reference["a1"][0]
        tokens, cached = run_one(second, "a1", A)  # never computed A
        assert tokens == reference["a1"][0]
        assert cached == (len(A) - 1) // BLOCK * BLOCK
        assert second.stats().kv_tiers["shared"]["hits"] == (len(A) - 1) // BLOCK
        assert second.stats().num_computed_prompt_tokens == len(A) - cached
        check_latent_records(first, tmp_path / "kv")
        assert first.kv_pool_is_whole() and second.kv_pool_is_whole()
    finally:
        first.close()
        second.close()


@pytest.mark.skipif(not mooncake_available(), reason="mooncake not installed")
def test_latent_blocks_shared_through_mooncake_store(tiny_deepseek, reference,
                                                     master):  # noqa: F811
    config, _ = master
    first, second = make_engine(tiny_deepseek, config), make_engine(tiny_deepseek, config)
    try:
        assert run_one(first, "a1", A)[0] == reference["a1"][0]
        wait_for_writes(first)
        tokens, cached = run_one(second, "a1", A)
        assert tokens == reference["a1"][0]
        assert cached == (len(A) - 1) // BLOCK * BLOCK
        assert second.stats().kv_tiers["mooncake"]["hits"] == (len(A) - 1) // BLOCK
        assert first.kv_pool_is_whole() and second.kv_pool_is_whole()
    finally:
        first.close()
        second.close()

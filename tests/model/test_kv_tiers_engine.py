"""KV tiers on the real default model: greedy output identical with tiers on and off.

Two engines with the same small pool run the same sequence of prompts; the pool cannot hold
them all, so with tiers the later ones load evicted prefixes back from a disk directory instead
of recomputing them. Outputs must be identical token for token, the loaded tokens must count as
cached, and every pool must be whole after each request. A restarted engine finds its directory
again; a removed directory degrades to recompute with the same output.
"""

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from hearth.config import KVOffloadConfig
from hearth.kv_tiers.store import make_store
from hearth.engine.engine import LLMEngine
from hearth.engine.sampling_params import SamplingParams

GOLDEN = json.loads((Path(__file__).parent / "golden" / "smollm2_greedy.json").read_text())
CASES = GOLDEN["cases"]
BLOCK = 16
NUM_BLOCKS = 20  # 320 tokens: one ~200-token prompt evicts most of another


def prompt(case_ids: list[int]) -> list[int]:
    return [t for i in case_ids for t in CASES[i]["prompt_ids"]]


A = prompt([0, 1, 2, 3])  # 169 tokens
B = prompt([4, 5, 6, 7])  # 203 tokens


def make_engine(models, directory: Path | None) -> LLMEngine:
    config = models.config(num_blocks=NUM_BLOCKS)
    if directory is None:
        return models.engine(config)
    config = replace(config, kv_offload=KVOffloadConfig(directory=str(directory)))
    return models.engine(config, store_factory=make_store)


def run_one(engine: LLMEngine, rid: str, ids: list[int], max_tokens: int = 12):
    engine.add_request(rid, ids, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                ignore_eos=True))
    tokens, final = [], None
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
            final = out
    assert final.finished and final.error is None, final
    if engine.tiers is not None:
        wait_for_writes(engine)
    assert engine.kv_pool_is_whole()
    return tokens, final.num_cached_tokens


def wait_for_writes(engine: LLMEngine) -> None:
    import time
    deadline = time.monotonic() + 10
    while engine.tiers.store.counters["queue_depth"] and time.monotonic() < deadline:
        time.sleep(0.01)


@pytest.fixture(scope="module")
def reference(models):
    """Outputs of the tier-less engine for each step of the sequence."""
    engine = make_engine(models, None)
    out = {}
    turn2 = None
    for rid, ids in (("a1", A), ("b1", B), ("a2", A)):
        out[rid] = run_one(engine, rid, ids)
    turn2 = A + out["a1"][0] + CASES[5]["prompt_ids"]  # the agent's next turn
    out["b2"] = run_one(engine, "b2", B)
    out["a3"] = run_one(engine, "a3", turn2)
    engine.close()
    return out, turn2


def test_greedy_output_is_identical_with_tiers_on_and_off(models, reference, tmp_path):
    ref, turn2 = reference
    engine = make_engine(models, tmp_path / "kv")
    got = {rid: run_one(engine, rid, ids)
           for rid, ids in (("a1", A), ("b1", B), ("a2", A), ("b2", B), ("a3", turn2))}
    for rid in got:
        assert got[rid][0] == ref[rid][0], rid
    # b1 pushed a1's blocks out of the pool: a2 loaded them from the disk instead
    full_blocks = (len(A) - 1) // BLOCK
    assert ref["a2"][1] < full_blocks * BLOCK  # without tiers most of A was recomputed
    assert got["a2"][1] == full_blocks * BLOCK  # with tiers all of A's full blocks are cached
    assert got["a3"][1] >= len(A) // BLOCK * BLOCK
    stats = engine.stats().kv_tiers
    assert stats["disk"]["hits"] > 0 and stats["disk"]["corrupt"] == 0
    assert stats["offload"]["load_failures"] == 0
    assert engine.stats().num_computed_prompt_tokens < sum(
        len(ids) for ids in (A, B, A, B, turn2)) - got["a2"][1]
    engine.close()


def test_a_restarted_engine_loads_from_its_directory(models, reference, tmp_path):
    ref, _ = reference
    first = make_engine(models, tmp_path / "kv")
    run_one(first, "a1", A)
    first.pool.reset_cache()  # eviction of everything: each cached block is offloaded
    wait_for_writes(first)
    first.close()
    engine = make_engine(models, tmp_path / "kv")  # as after a restart
    tokens, cached = run_one(engine, "a1", A)
    assert tokens == ref["a1"][0]
    assert cached == (len(A) - 1) // BLOCK * BLOCK
    assert engine.stats().kv_tiers["disk"]["hits"] == (len(A) - 1) // BLOCK
    engine.close()


def test_a_removed_directory_degrades_to_recompute_with_the_same_output(models, reference,
                                                                         tmp_path):
    ref, _ = reference
    engine = make_engine(models, tmp_path / "kv")
    run_one(engine, "a1", A)
    engine.pool.reset_cache()
    wait_for_writes(engine)
    shutil.rmtree(tmp_path / "kv")  # unplugged: the store's index still lists every block
    engine.add_request("a2", A, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    tokens, final = [], None
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
            final = out
            assert out.error is None
    assert tokens == ref["a2"][0] and final.num_cached_tokens == 0
    stats = engine.stats().kv_tiers
    # a failed read (a load's, or a read ahead's before admission: either may come first)
    # dropped its block from the index, and nothing reached the pool from the tier
    assert stats["offload"]["load_blocks"] == 0 and stats["disk"]["hits"] == 0
    assert stats["disk"]["num_blocks"] < (len(A) - 1) // BLOCK
    assert engine.kv_pool_is_whole()
    engine.close()

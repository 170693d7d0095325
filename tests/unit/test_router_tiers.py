"""The router's view of the KV tiers below each worker's pool, and the policy's tier cost."""

from __future__ import annotations

import msgspec
import pytest

from hearth.engine.kv.block_hash import hash_blocks
from hearth.router.endpoints import EndpointPool
from hearth.api.load_report import LoadReport
from hearth.router.policy import (EndpointView, PolicyConfig, RequestView, choose,
                                  num_tier_tokens)

BLOCK = 16
CONFIG = PolicyConfig(block_size=BLOCK)


def make_request(num_tokens: int, seed: int = 0) -> RequestView:
    ids = [(seed * 1000 + i) % 30000 for i in range(num_tokens)]
    return RequestView(num_tokens, hash_blocks(ids, BLOCK))


def test_tier_tokens_continue_the_pool_prefix_and_never_the_last_token():
    r = make_request(64)  # 4 blocks
    tiers = frozenset(r.block_hashes[1:4])
    assert num_tier_tokens(r, tiers, 16, BLOCK) == 47  # blocks 1..3, but the last token is computed
    assert num_tier_tokens(r, tiers, 0, BLOCK) == 0  # block 0 missing: nothing to continue
    assert num_tier_tokens(r, frozenset(r.block_hashes[1:2]), 16, BLOCK) == 16


def test_a_tier_hit_is_cheaper_than_recompute_and_dearer_than_the_pool():
    r = make_request(1024)  # 64 blocks
    pool_only = EndpointView("w0", "both", True, 0, 0, frozenset(r.block_hashes[:16]))
    with_tier = EndpointView("w1", "both", True, 0, 0, frozenset(r.block_hashes[:16]),
                             frozenset(r.block_hashes[16:48]))
    all_pool = EndpointView("w2", "both", True, 0, 0, frozenset(r.block_hashes[:48]))
    decode = CONFIG.decode_weight * 1024
    d = choose(r, [pool_only, with_tier], CONFIG)
    assert d.decode == "w1" and d.num_cached_decode == 768  # 256 in the pool + 512 loaded
    assert d.cost == pytest.approx(decode + 256 * 1.0 + 512 * CONFIG.tier_weight)
    assert choose(r, [with_tier, all_pool], CONFIG).decode == "w2"
    assert choose(r, [pool_only], CONFIG).cost == pytest.approx(decode + 768)


def test_a_decode_worker_whose_shared_tier_holds_the_prompt_skips_the_prefill_hop():
    r = make_request(1024)
    prefill = EndpointView("p0", "prefill", True)
    cold = EndpointView("d0", "decode", True)
    warm = EndpointView("d1", "decode", True, tier_hashes=frozenset(r.block_hashes))
    assert choose(r, [prefill, cold], CONFIG).prefill == "p0"
    d = choose(r, [prefill, warm], CONFIG)
    assert (d.prefill, d.decode, d.reason) == (None, "d1", "cached")


def load_body(cursor: int, tiers: dict) -> LoadReport:
    return msgspec.convert({"role": "both", "block_size": BLOCK, "num_total_blocks": 64,
                            "block_events": {"cursor": cursor, "stored": [], "evicted": [],
                                             "tiers": tiers}}, LoadReport)


def test_reports_fill_own_and_shared_tier_views():
    pool = EndpointPool([], [], ["http://a", "http://b", "http://c"])
    a, b, c = pool["http://a"], pool["http://b"], pool["http://c"]
    a.apply_report(load_body(5, {"disk": {"stored": [1, 2], "evicted": []},
                                 "shared": {"stored": [10, 11, 12], "evicted": [12]}}), (0, 0))
    b.apply_report(load_body(3, {"shared": {"stored": [13], "evicted": []}}), (0, 0))
    va, vb, vc = (e.view() for e in (a, b, c))
    assert 1 in va.tier_hashes and 1 not in vb.tier_hashes  # a's own disk
    assert all(h in va.tier_hashes and h in vb.tier_hashes for h in (10, 11, 13))
    assert 12 not in va.tier_hashes  # evicted from the shared store
    assert 10 not in vc.tier_hashes  # c never reported a shared tier: not assumed to have one
    a.apply_report(load_body(1, {}), (0, 0))  # a restarted (cursor went back)
    assert 1 not in a.view().tier_hashes and 10 in a.view().tier_hashes

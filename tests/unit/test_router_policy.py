"""The routing policy on fake endpoint views: exact choices, no I/O, no model."""

from __future__ import annotations

import json

import pytest

from hearth.engine.kv.block_hash import hash_blocks
from hearth.router.endpoints import CacheView, EndpointPool, SessionTable, Ticket
from hearth.api.load_report import LoadReport, decode_load_report
from hearth.router.policy import (Decision, EndpointView, NoEndpointError, PolicyConfig, RequestView,
                                  choose, choose_prefill, num_cached_tokens)

BLOCK = 16
CONFIG = PolicyConfig(block_size=BLOCK)


def make_request(num_tokens: int, seed: int = 0, **kwargs) -> RequestView:
    ids = [(seed * 1000 + i) % 30000 for i in range(num_tokens)]
    return RequestView(num_tokens, hash_blocks(ids, BLOCK), **kwargs)


def cached(request: RequestView, num_blocks: int) -> frozenset[int]:
    return frozenset(request.block_hashes[:num_blocks])


def make_endpoint(name: str, role: str, healthy: bool = True, prefill: int = 0, decode: int = 0,
                  hashes: frozenset[int] = frozenset()) -> EndpointView:
    return EndpointView(name, role, healthy, prefill, decode, hashes)


def test_num_cached_tokens_is_the_longest_prefix_and_never_the_last_token():
    r = make_request(64)
    assert num_cached_tokens(r, cached(r, 2), BLOCK) == 32
    # A hole breaks the prefix: block 3 alone does not count.
    assert num_cached_tokens(r, frozenset([r.block_hashes[0], r.block_hashes[2]]), BLOCK) == 16
    # Every block cached: the last prompt token is still computed (its logits are needed).
    assert num_cached_tokens(r, cached(r, 4), BLOCK) == 63


def test_lowest_cost_pair_is_the_least_loaded_prefill_and_decode():
    r = make_request(1000)
    endpoints = [make_endpoint("p0", "prefill", prefill=3000), make_endpoint("p1", "prefill", prefill=500),
                 make_endpoint("d0", "decode", decode=1000), make_endpoint("d1", "decode", decode=20000)]
    d = choose(r, endpoints, CONFIG)
    assert (d.prefill, d.decode, d.reason) == ("p1", "d0", "cost")
    # prefill 500 + 1000 uncached; decode 0.1 * (1000 + 1000); transfer 0.05 * 1000
    assert d.cost == pytest.approx(1500 + 200 + 50)


def test_prefill_cost_counts_only_uncached_tokens():
    r = make_request(1024)
    # p0 is busier (600 tokens in flight) but holds 960 of the 1024 prompt tokens.
    endpoints = [make_endpoint("p0", "prefill", prefill=600, hashes=cached(r, 60)),
                 make_endpoint("p1", "prefill", prefill=100), make_endpoint("d0", "decode")]
    d = choose(r, endpoints, CONFIG)
    assert d.prefill == "p0" and d.num_cached_prefill == 960
    # Without the cache p1 wins: 100 + 1024 < 600 + 1024.
    endpoints[0] = make_endpoint("p0", "prefill", prefill=600)
    assert choose(r, endpoints, CONFIG).prefill == "p1"


def test_unhealthy_endpoints_are_never_chosen_and_none_left_is_an_error():
    r = make_request(100)
    endpoints = [make_endpoint("p0", "prefill", healthy=False), make_endpoint("p1", "prefill", prefill=9999),
                 make_endpoint("d0", "decode", healthy=False), make_endpoint("d1", "decode", decode=99999)]
    d = choose(r, endpoints, CONFIG)
    assert (d.prefill, d.decode) == ("p1", "d1")
    with pytest.raises(NoEndpointError):
        choose(r, [make_endpoint("p0", "prefill"), make_endpoint("d0", "decode", healthy=False)], CONFIG)


def test_without_prefill_endpoints_the_decode_endpoint_prefills_itself():
    r = make_request(100)
    d = choose(r, [make_endpoint("p0", "prefill", healthy=False), make_endpoint("d0", "decode")], CONFIG)
    assert (d.prefill, d.decode, d.reason) == (None, "d0", "cached")


def test_conditional_disaggregation_threshold():
    r = make_request(1000)  # 62 full blocks
    prefill = make_endpoint("p0", "prefill")
    # The decode endpoint holds 60 blocks = 960 tokens = 96% >= 90%: no prefill hop.
    d = choose(r, [prefill, make_endpoint("d0", "decode", hashes=cached(r, 60))], CONFIG)
    assert (d.prefill, d.decode, d.reason, d.num_cached_decode) == (None, "d0", "cached", 960)
    # 800 tokens = 80% < 90%: the prefill hop runs, only the missing 200 tokens cross the wire.
    d = choose(r, [prefill, make_endpoint("d0", "decode", hashes=cached(r, 50))], CONFIG)
    assert (d.prefill, d.decode, d.num_cached_decode) == ("p0", "d0", 800)
    # A lower threshold accepts 80%.
    low = PolicyConfig(block_size=BLOCK, disagg_threshold=0.75)
    d = choose(r, [prefill, make_endpoint("d0", "decode", hashes=cached(r, 50))], low)
    assert d.prefill is None


def test_requests_that_cannot_be_split_are_never_disaggregated():
    r = make_request(500, can_disaggregate=False)
    d = choose(r, [make_endpoint("p0", "prefill"), make_endpoint("d0", "decode")], CONFIG)
    assert (d.prefill, d.decode) == (None, "d0")


def test_headerless_longest_prefix_routing_prefers_the_decode_endpoint_holding_the_history():
    r = make_request(2000)
    endpoints = [make_endpoint("p0", "prefill"),
                 make_endpoint("d0", "decode", hashes=cached(r, 40)),  # 640 tokens
                 make_endpoint("d1", "decode", hashes=cached(r, 120))]  # 1920 tokens = 96%
    d = choose(r, endpoints, CONFIG)
    assert (d.decode, d.prefill, d.reason) == ("d1", None, "cached")
    # Below the threshold the longer prefix still wins the decode choice (less to transfer).
    endpoints[2] = make_endpoint("d1", "decode", hashes=cached(r, 100))
    d = choose(r, endpoints, CONFIG)
    assert (d.decode, d.prefill) == ("d1", "p0")


def test_session_affinity_is_kept_while_healthy_and_not_overloaded():
    r = make_request(1000, affinity=("p1", "d1"))
    endpoints = [make_endpoint("p0", "prefill"), make_endpoint("p1", "prefill", prefill=200),
                 make_endpoint("d0", "decode"), make_endpoint("d1", "decode", decode=5000)]
    d = choose(r, endpoints, CONFIG)
    assert (d.prefill, d.decode, d.reason) == ("p1", "d1", "affinity")
    # Overloaded: d1's cost is past 2 x best + 2048.
    endpoints[3] = make_endpoint("d1", "decode", decode=80000)
    d = choose(r, endpoints, CONFIG)
    assert (d.prefill, d.decode, d.reason) == ("p0", "d0", "cost")
    # Unhealthy decode: the session moves.
    endpoints[3] = make_endpoint("d1", "decode", healthy=False)
    assert choose(r, endpoints, CONFIG).decode == "d0"
    # Its prefill endpoint gone: the decode endpoint is kept, the cheapest prefill replaces it.
    endpoints[1] = make_endpoint("p1", "prefill", healthy=False)
    endpoints[3] = make_endpoint("d1", "decode", decode=5000)
    d = choose(r, endpoints, CONFIG)
    assert (d.prefill, d.decode, d.reason) == ("p0", "d1", "affinity")


def test_monolithic_workers_compete_on_the_same_cost():
    r = make_request(1000)
    endpoints = [make_endpoint("w0", "both", prefill=5000), make_endpoint("w1", "both", decode=1000)]
    d = choose(r, endpoints, CONFIG)
    assert (d.prefill, d.decode) == (None, "w1")
    assert d.cost == pytest.approx(0.1 * 2000 + 1000)


def test_round_robin_cycles_blind_to_caches():
    endpoints = [make_endpoint("p0", "prefill"), make_endpoint("p1", "prefill"),
                 make_endpoint("d0", "decode"), make_endpoint("d1", "decode")]
    config = PolicyConfig(name="round_robin", block_size=BLOCK)
    picks = [choose(make_request(100, sequence=i), endpoints, config) for i in range(4)]
    assert [(d.prefill, d.decode) for d in picks] == [("p0", "d0"), ("p1", "d1")] * 2
    assert {d.reason for d in picks} == {"round_robin"}


def test_choose_prefill_for_a_retry_skips_the_failed_endpoint():
    r = make_request(300)
    endpoints = [make_endpoint("p0", "prefill", healthy=False), make_endpoint("p1", "prefill", hashes=cached(r, 3)),
                 make_endpoint("d0", "decode")]
    assert choose_prefill(r, endpoints, CONFIG) == ("p1", 48)
    assert choose_prefill(r, endpoints[:1], CONFIG) is None


def test_policy_config_rejects_nonsense():
    with pytest.raises(ValueError):
        PolicyConfig(name="random")
    with pytest.raises(ValueError):
        PolicyConfig(disagg_threshold=1.5)


# ---- bookkeeping around the policy (endpoints.py) ---------------------------------------------


def test_cache_view_is_lru_bounded_and_corrected_by_events():
    view = CacheView(capacity=3)
    view.touch([1, 2, 3])
    view.touch([1])  # 1 is now the most recent
    view.touch([4])  # evicts 2, the least recent
    assert [h for h in (1, 2, 3, 4) if h in view] == [1, 3, 4]
    view.apply_events(stored=[5], evicted=[3])
    assert [h for h in (1, 3, 4, 5) if h in view] == [1, 4, 5]


def test_ticket_takes_back_every_prediction_on_every_path():
    pool = EndpointPool(["http://p"], ["http://d0", "http://d1"], [])
    decision = Decision("http://d0", "http://p", "cost", 100, 0, 0.0)
    ticket = pool.begin(decision, 1000, [11, 12])
    p, d0, d1 = pool["http://p"], pool["http://d0"], pool["http://d1"]
    assert (p.own_prefill_tokens, d0.own_requests) == (900, 1)
    assert 11 in p.cache and 12 in d0.cache and d0.counters.routed == 1
    ticket.first_token()
    assert (p.own_prefill_tokens, d0.own_decode_tokens) == (0, 1000)
    ticket.move_decode(d1)  # a continuation on another decode endpoint
    assert (d0.own_decode_tokens, d0.own_requests, d1.own_decode_tokens, d1.own_requests) == (0, 0, 1000, 1)
    assert (d0.counters.routed, d1.counters.routed) == (1, 1)
    ticket.close()
    ticket.close()  # idempotent
    assert all((e.own_prefill_tokens, e.own_decode_tokens, e.own_requests) == (0, 0, 0) for e in pool)


def test_ticket_closed_before_the_first_token_and_after_a_prefill_retry():
    pool = EndpointPool(["http://p0", "http://p1"], ["http://d"], [])
    ticket: Ticket = pool.begin(Decision("http://d", "http://p0", "cost", 0, 0, 0.0), 500, [])
    ticket.move_prefill(pool["http://p1"], 500)
    assert (pool["http://p0"].own_prefill_tokens, pool["http://p1"].own_prefill_tokens) == (0, 500)
    assert pool["http://p1"].counters.routed == 1
    ticket.move_prefill(None, 400)  # no prefill endpoint left: the decode endpoint computes it
    assert (pool["http://p1"].own_prefill_tokens, pool["http://d"].own_prefill_tokens) == (0, 400)
    ticket.close()
    assert all((e.own_prefill_tokens, e.own_requests) == (0, 0) for e in pool)


def load_report(**fields) -> LoadReport:
    """A decode worker's /load body as the router decodes it (JSON -> LoadReport)."""
    return decode_load_report(json.dumps({"role": "decode", "block_size": BLOCK, **fields}).encode())


def test_load_estimate_adds_only_load_beyond_the_routers_own():
    pool = EndpointPool([], ["http://d"], [])
    d = pool["http://d"]
    d.own_decode_tokens = 1000
    d.apply_report(load_report(num_decode_tokens_active=1500, num_prefill_tokens_inflight=0,
                               num_total_blocks=10,
                               block_events={"cursor": 7, "stored": [1, 2], "evicted": []}),
                   (1000, 1000))
    assert d.decode_tokens == 1500 and d.extra_decode_tokens == 500
    assert 1 in d.cache and d.events_cursor == 7 and d.cache.capacity == 10
    # A cursor that went backwards: the worker restarted, its cache is empty.
    d.apply_report(load_report(block_events={"cursor": 2, "stored": [9], "evicted": []}), (0, 0))
    assert 1 not in d.cache and 9 in d.cache


def test_session_table_is_bounded():
    table = SessionTable(capacity=2)
    table.put("a", (None, "d0"))
    table.put("b", ("p", "d1"))
    table.put("c", ("p", "d0"))
    assert table.get("a") is None and table.get("b") == ("p", "d1") and len(table) == 2
    assert table.get(None) is None

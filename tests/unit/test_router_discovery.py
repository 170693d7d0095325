"""Discovery: the router's endpoint pool follows a registry (hearth/router/discovery.py)."""

from __future__ import annotations

import asyncio

import pytest

from hearth.config import Role
from hearth.router.discovery import DiscoveryLoop, WorkerRecord
from hearth.router.endpoints import EndpointPool
from hearth.router.policy import Decision


def rec(name: str, role: str, url: str, draining: bool = False) -> WorkerRecord:
    return WorkerRecord(name=name, role=role, url=url, draining=draining)


class FakeRegistry:
    def __init__(self) -> None:
        self.v, self.list, self.acks, self.fail = 0, [], [], False

    def set(self, *records: WorkerRecord) -> None:
        self.v += 1
        self.list = list(records)

    def version(self) -> int:
        if self.fail:
            raise ConnectionError("registry gone")
        return self.v

    def records(self):
        return self.v, list(self.list)

    def acknowledge(self, version, in_flight, healthy) -> None:
        self.acks.append((version, dict(in_flight)))
        self.healthy = list(healthy)


def test_a_dynamic_pool_may_start_empty_a_static_one_may_not():
    assert list(EndpointPool([], [], [], dynamic=True)) == []
    with pytest.raises(ValueError, match="at least one --decode"):
        EndpointPool([], [], [])


def test_reconcile_adds_removes_and_marks_draining():
    pool = EndpointPool([], [], [], dynamic=True)
    added, removed = pool.reconcile([rec("prefill-0", "prefill", "http://p"),
                                     rec("decode-1", "decode", "http://d1/")])
    assert [e.url for e in added] == ["http://p", "http://d1"] and removed == []
    assert all(not e.healthy for e in pool)  # until their first /load answers
    for e in pool:
        e.healthy = True
    assert pool.is_ready()
    added, removed = pool.reconcile([rec("prefill-0", "prefill", "http://p"),
                                     rec("decode-1", "decode", "http://d1", draining=True),
                                     rec("decode-2", "decode", "http://d2")])
    assert [e.url for e in added] == ["http://d2"] and removed == []
    d1 = pool["http://d1"]
    assert d1.draining and d1.name == "decode-1" and d1.healthy
    views = {v.name: v.healthy for v in pool.views()}
    assert views == {"http://p": True, "http://d1": False, "http://d2": False}  # d1 takes nothing new
    assert not pool.is_ready()  # d2 not checked yet, d1 draining


def test_a_removed_endpoint_stays_reachable_while_the_router_has_requests_there():
    pool = EndpointPool([], [], [], dynamic=True)
    pool.reconcile([rec("p", "prefill", "http://p"), rec("d", "decode", "http://d")])
    ticket = pool.begin(Decision("http://d", "http://p", "cost", 0, 0, 0.0), 100, [])
    assert pool.in_flight() == {"http://p": 1, "http://d": 1}
    _, removed = pool.reconcile([])
    assert {e.url for e in removed} == {"http://p", "http://d"}
    assert [e.url for e in pool] == [] and pool["http://d"].own_requests == 1
    ticket.first_token()  # the prefill hop is over: p is forgotten, d is still streaming
    assert pool.in_flight() == {"http://d": 1}
    assert pool.get("http://p") is None
    ticket.close()
    assert pool.in_flight() == {} and pool.get("http://d") is None


def test_a_new_worker_on_an_old_url_with_another_role_is_a_new_endpoint():
    pool = EndpointPool([], [], [], dynamic=True)
    pool.reconcile([rec("a", "decode", "http://x")])
    old = pool["http://x"]
    added, removed = pool.reconcile([rec("b", "both", "http://x")])
    assert removed == [old] and added[0] is pool["http://x"] and added[0].role is Role.BOTH


def test_prefill_hops_count_until_the_first_token_or_close():
    pool = EndpointPool(["http://p0", "http://p1"], ["http://d"], [])
    ticket = pool.begin(Decision("http://d", "http://p0", "cost", 0, 0, 0.0), 10, [])
    assert pool["http://p0"].own_prefill_hops == 1
    ticket.move_prefill(pool["http://p1"], 10)
    assert (pool["http://p0"].own_prefill_hops, pool["http://p1"].own_prefill_hops) == (0, 1)
    ticket.close()
    ticket.close()
    assert all(e.own_prefill_hops == 0 and e.own_requests == 0 for e in pool)


def test_discovery_loop_applies_versions_acknowledges_and_survives_a_lost_registry():
    registry = FakeRegistry()
    pool = EndpointPool([], [], [], dynamic=True)
    changes = []
    loop = DiscoveryLoop(registry, pool, 0.01, lambda a, r: changes.append((a, r)))

    async def run():
        registry.set(rec("d", "decode", "http://d"))
        assert await loop.poll_once()
        assert registry.healthy == []  # discovered, not yet routed to: no /load answered
        pool["http://d"].healthy = True  # (what its health loop does on a first answer)
        assert not await loop.poll_once()  # same version: nothing re-read
        assert registry.healthy == ["d"]  # routed to now: `hearth scale --wait` may return
        registry.fail = True
        assert not await loop.poll_once()  # kept what it had
        assert [e.url for e in pool] == ["http://d"]
        registry.fail = False
        registry.set()
        assert await loop.poll_once()

    asyncio.run(run())
    assert [e.url for e in changes[0][0]] == ["http://d"]
    assert [e.url for e in changes[1][1]] == ["http://d"] and list(pool) == []
    assert registry.acks == [(1, {"http://d": 0}), (1, {"http://d": 0}), (2, {})]
    assert loop.applied == 2

"""Rank liveness through the rendezvous store, with threads standing in for rank processes."""

import threading
import time

from hearth.ops.distributed import Heartbeat, RankLayout, connect_store

LAYOUT = RankLayout(tensor_parallel_size=1, pipeline_parallel_size=3)


def start_heartbeats(port: int, failures: dict, ranks=(0, 1, 2),
                     stale_after_s: float = 0.5) -> dict[int, Heartbeat]:
    beats = {}
    for rank in ranks:
        def record(why: str, rank=rank) -> None:
            failures[rank] = (why, time.monotonic())
        beats[rank] = Heartbeat(lambda: connect_store("127.0.0.1", port, False, 5.0), rank,
                                LAYOUT, record, interval_s=0.05,
                                stale_after_s=stale_after_s).start()
    return beats


def wait_for(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.02)
    return predicate()


def test_a_silent_rank_is_named_by_the_others_within_the_stale_window():
    store = connect_store("127.0.0.1", 0, True, 5.0)
    failures: dict = {}
    beats = start_heartbeats(store.port, failures)
    time.sleep(0.8)
    assert failures == {}  # everyone beating: nobody is reported
    stopped_at = time.monotonic()
    beats[2].stop()
    assert wait_for(lambda: 0 in failures and 1 in failures)
    for rank in (0, 1):
        why, when = failures[rank]
        assert why == "rank 2 (stage 2, tp 0) stopped responding (no heartbeat for 0.5s)"
        assert when - stopped_at < 2.0
    assert 2 not in failures
    for beat in beats.values():
        beat.stop()


def test_losing_the_store_is_a_failure():
    store = connect_store("127.0.0.1", 0, True, 5.0)
    failures: dict = {}
    beats = start_heartbeats(store.port, failures, ranks=(1,), stale_after_s=60.0)
    time.sleep(0.2)
    del store  # the store host (rank 0 or the launcher) is gone
    assert wait_for(lambda: 1 in failures)
    assert failures[1][0].startswith("lost the rendezvous store")
    beats[1].stop()


def test_stop_is_quiet():
    store = connect_store("127.0.0.1", 0, True, 5.0)
    failures: dict = {}
    beats = start_heartbeats(store.port, failures)
    time.sleep(0.2)
    for beat in beats.values():
        beat.stop()
    time.sleep(0.8)
    assert failures == {} and all(not t.is_alive() for t in threading.enumerate()
                                  if t.name.startswith("hearth-heartbeat"))

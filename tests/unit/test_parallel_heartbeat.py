"""Rank liveness through the rendezvous store, with threads standing in for rank processes.

No test here reads the clock: each waits for a condition (beats counted in the store, a failure
reported, threads ended); the deadline in `wait_for` only turns a hang into a failure. The stale
window is 1 s, twenty beat intervals, so a busy machine does not make a beating rank look dead.
"""

import threading
import time

import pytest

from hearth.engine.parallel.distributed import Heartbeat, RankLayout, connect_store

LAYOUT = RankLayout(tensor_parallel_size=1, pipeline_parallel_size=3)
INTERVAL_S = 0.05
STALE_S = 1.0


def start_heartbeats(port: int, failures: dict, ranks=(0, 1, 2),
                     stale_after_s: float = STALE_S) -> dict[int, Heartbeat]:
    """`failures[rank]` = (message, order in which it was reported) as ranks report."""
    beats = {}
    for rank in ranks:
        def record(why: str, rank=rank) -> None:
            failures[rank] = (why, len(failures))
        beats[rank] = Heartbeat(lambda: connect_store("127.0.0.1", port, False, 5.0), rank,
                                LAYOUT, record, interval_s=INTERVAL_S,
                                stale_after_s=stale_after_s).start()
    return beats


def num_beats(store, rank: int) -> int:
    return store.add(f"hearth/heartbeat/{rank}", 0)


def wait_for(predicate, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not seen in {timeout:.0f}s")
        time.sleep(0.01)


def stop_and_join(beats: dict[int, Heartbeat]) -> None:
    for beat in beats.values():
        beat.stop()
    for beat in beats.values():
        beat._thread.join(timeout=60)
        assert not beat._thread.is_alive()


def test_a_silent_rank_is_named_by_the_others():
    store = connect_store("127.0.0.1", 0, True, 5.0)
    failures: dict = {}
    beats = start_heartbeats(store.port, failures)
    # Beats for longer than the stale window (25 intervals > 1 s) from everyone: nobody reported.
    wait_for(lambda: all(num_beats(store, r) >= 25 for r in range(3)), "25 beats from each rank")
    assert failures == {}
    beats[2].stop()
    beats[2]._thread.join(timeout=60)
    wait_for(lambda: 0 in failures and 1 in failures, "ranks 0 and 1 reporting rank 2")
    for rank in (0, 1):
        assert failures[rank][0] == "rank 2 (stage 2, tp 0) stopped responding (no heartbeat for 1s)"
    assert 2 not in failures
    stop_and_join(beats)


def test_losing_the_store_is_a_failure():
    store = connect_store("127.0.0.1", 0, True, 5.0)
    failures: dict = {}
    beats = start_heartbeats(store.port, failures, ranks=(1,), stale_after_s=60.0)
    wait_for(lambda: num_beats(store, 1) >= 2, "rank 1 beating")
    del store  # the store host (rank 0 or the launcher) is gone
    wait_for(lambda: 1 in failures, "rank 1 reporting the lost store")
    assert failures[1][0].startswith("lost the rendezvous store")
    stop_and_join(beats)


def test_stop_is_quiet():
    store = connect_store("127.0.0.1", 0, True, 5.0)
    failures: dict = {}
    beats = start_heartbeats(store.port, failures)
    wait_for(lambda: all(num_beats(store, r) >= 3 for r in range(3)), "3 beats from each rank")
    stop_and_join(beats)  # the threads have ended: nothing can be reported after this
    assert failures == {}
    assert not [t for t in threading.enumerate() if t.name.startswith("hearth-heartbeat")]

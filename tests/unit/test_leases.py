"""LeaseManager: every lease's blocks come back exactly once, never while a reader holds them."""

import pytest

from hearth.kv_transfer.leases import LeaseManager


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_leases(seconds: float = 10.0):
    clock = FakeClock()
    return LeaseManager(seconds, clock), clock


def test_ack_releases_once():
    leases, _ = make_leases()
    leases.create("t1", [3, 4, 5])
    assert leases.num_active == 1 and leases.take_released() == []
    assert leases.release("t1", "ack")
    assert leases.take_released() == [[3, 4, 5]]
    assert leases.take_released() == []
    assert not leases.release("t1", "ack")  # a second ack finds nothing
    assert leases.num_active == 0 and leases.counts["ack"] == 1


def test_reject_releases():
    leases, _ = make_leases()
    leases.create("t1", [7])
    assert leases.release("t1", "reject")
    assert leases.take_released() == [[7]] and leases.counts["reject"] == 1


def test_expiry_releases_on_sweep_and_refuses_readers():
    leases, clock = make_leases(10.0)
    leases.create("t1", [1, 2])
    leases.create("t2", [9])
    clock.now += 9.999
    assert leases.sweep() == 0 and leases.begin_read("t1") == [1, 2]
    leases.end_read("t1")
    clock.now += 0.001
    assert leases.sweep() == 2
    assert sorted(leases.take_released()) == [[1, 2], [9]]
    assert leases.begin_read("t1") is None and not leases.release("t2", "ack")
    assert leases.counts["expired"] == 2


def test_expired_but_unswept_lease_refuses_a_reader():
    leases, clock = make_leases(5.0)
    leases.create("t1", [4])
    clock.now += 5.0
    assert leases.begin_read("t1") is None
    assert leases.take_released() == [[4]]  # ended (and released) by that refusal


def test_read_guard_holds_blocks_past_expiry():
    leases, clock = make_leases(5.0)
    leases.create("t1", [8, 9])
    assert leases.begin_read("t1") == [8, 9]
    clock.now += 60
    assert leases.sweep() == 1
    assert leases.take_released() == []  # still being read: not reusable yet
    assert leases.num_active == 1
    assert leases.begin_read("t1") is None  # but no new reader gets in
    leases.end_read("t1")
    assert leases.take_released() == [[8, 9]] and leases.num_active == 0


def test_ack_during_read_waits_for_the_reader():
    leases, _ = make_leases()
    leases.create("t1", [2])
    leases.begin_read("t1")
    leases.begin_read("t1")
    assert leases.release("t1", "ack")
    leases.end_read("t1")
    assert leases.take_released() == []
    leases.end_read("t1")
    assert leases.take_released() == [[2]]


def test_duplicate_transfer_id_is_refused_until_released():
    leases, _ = make_leases()
    leases.create("t1", [1])
    with pytest.raises(ValueError, match="already leased"):
        leases.create("t1", [2])
    leases.release("t1", "ack")
    leases.take_released()
    leases.create("t1", [2])
    assert leases.contains("t1")


def test_close_ends_every_lease():
    leases, _ = make_leases()
    leases.create("a", [1])
    leases.create("b", [2])
    leases.begin_read("b")
    leases.close()
    assert leases.take_released() == [[1]]
    leases.end_read("b")
    assert leases.take_released() == [[2]] and leases.counts["closed"] == 2


def test_lease_seconds_must_be_positive():
    with pytest.raises(ValueError):
        LeaseManager(0)


def test_blocks_past_the_cap_end_the_oldest_unread_leases_first():
    leases = LeaseManager(10.0, FakeClock(), max_blocks=6)
    leases.create("a", [1, 2])
    leases.create("b", [3, 4])
    leases.create("c", [5, 6])
    assert leases.take_released() == [] and leases.num_held_blocks == 6
    assert leases.begin_read("a") == [1, 2]  # a transfer in progress is not cut short
    leases.create("d", [7, 8, 9])  # 9 held: b and c go, in age order, a is being read
    assert leases.take_released() == [[3, 4], [5, 6]]
    assert leases.counts["evicted"] == 2 and leases.num_held_blocks == 5
    assert leases.begin_read("b") is None  # an evicted lease answers like an unknown one
    leases.end_read("a")
    assert leases.release("a", "ack") and leases.take_released() == [[1, 2]]
    assert leases.contains("d") and leases.num_held_blocks == 3


def test_a_lease_larger_than_the_cap_is_kept_alone_and_shared_blocks_count_once():
    leases = LeaseManager(10.0, FakeClock(), max_blocks=4)
    leases.create("a", [1, 2, 3])
    leases.create("b", [1, 2, 3, 4])  # the same prompt's blocks plus one: 4 distinct, fits
    assert leases.take_released() == [] and leases.num_held_blocks == 4
    leases.create("big", [10, 11, 12, 13, 14])  # over the cap on its own: everything else goes
    assert leases.take_released() == [[1, 2, 3], [1, 2, 3, 4]]
    assert leases.num_active == 1 and leases.num_held_blocks == 5
    leases.release("big", "ack")
    assert leases.take_released() == [[10, 11, 12, 13, 14]] and leases.num_held_blocks == 0

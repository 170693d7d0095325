"""Leases on exported KV blocks (prefill side).

A lease holds one reference on each block of an exported prompt, keyed by transfer id, until the
decode side acknowledges, rejects, or the lease expires. Readers (transfer threads sending the
blocks) hold a read guard; a lease that ends while read keeps its blocks until the last reader
is done, so a block is never handed to another request while its bytes are still going out.

    create -> active --ack | reject | expiry | eviction | close--> ended --last reader done--> released

Eviction bounds what leases pin: when the distinct blocks held by leases exceed `max_blocks`,
the oldest active, unread leases end ("evicted") until they fit, never the one just created. A
prefill whose decode hop never comes (the client left after the first token) so holds its
blocks at most until newer exports need the room, and new prefills keep the rest of the pool.

Released leases wait in `take_released` for the engine thread, which alone frees blocks.
Thread-safe: transfer threads call begin_read/end_read/release, the engine calls the rest.
The clock is injected (monotonic seconds) so tests drive expiry without sleeping.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable


@dataclass
class Lease:
    transfer_id: str
    block_ids: list[int]
    expires_at: float  # clock time
    num_readers: int = 0
    ended: str | None = None  # why it ended: "ack" | "reject" | "expired" | "evicted" | "closed"


class LeaseManager:
    def __init__(self, lease_seconds: float, clock: Callable[[], float] = time.monotonic,
                 max_blocks: int | None = None) -> None:
        if lease_seconds <= 0:
            raise ValueError(f"lease_seconds must be > 0, got {lease_seconds}")
        if max_blocks is not None and max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
        self.lease_seconds = lease_seconds
        self.clock = clock
        self.max_blocks = max_blocks  # None: no cap
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}  # active and ended-but-read leases, oldest first
        self._held = Counter()  # block id -> leases in _leases holding it
        self._released: list[list[int]] = []
        self.counts = dict(created=0, ack=0, reject=0, expired=0, evicted=0, closed=0)

    def create(self, transfer_id: str, block_ids: list[int]) -> Lease:
        with self._lock:
            if transfer_id in self._leases:
                raise ValueError(f"kv_transfer.transfer_id: {transfer_id!r} is already leased")
            lease = Lease(transfer_id, list(block_ids), self.clock() + self.lease_seconds)
            self._leases[transfer_id] = lease
            self._held.update(lease.block_ids)
            self.counts["created"] += 1
            self._evict_over_cap(keep=lease)
            return lease

    @property
    def num_held_blocks(self) -> int:
        """Distinct blocks that leases (active or still being read) keep from the pool."""
        with self._lock:
            return len(self._held)

    def contains(self, transfer_id: str) -> bool:
        with self._lock:
            return transfer_id in self._leases

    def begin_read(self, transfer_id: str) -> list[int] | None:
        """Guard the lease's blocks for reading; None if it is unknown, ended or expired."""
        with self._lock:
            lease = self._live(transfer_id)
            if lease is None:
                return None
            lease.num_readers += 1
            return list(lease.block_ids)

    def end_read(self, transfer_id: str) -> None:
        with self._lock:
            lease = self._leases[transfer_id]
            lease.num_readers -= 1
            assert lease.num_readers >= 0, lease
            self._release_if_done(lease)

    def release(self, transfer_id: str, reason: str) -> bool:
        """End a lease on the decode side's word ("ack" | "reject"); False if unknown/ended."""
        with self._lock:
            lease = self._live(transfer_id)
            if lease is None:
                return False
            self._end(lease, reason)
            return True

    def sweep(self) -> int:
        """End every lease past its expiry; returns how many ended now."""
        with self._lock:
            now = self.clock()
            due = [le for le in self._leases.values() if le.ended is None and now >= le.expires_at]
            for lease in due:
                self._end(lease, "expired")
            return len(due)

    def close(self) -> None:
        with self._lock:
            for lease in list(self._leases.values()):
                if lease.ended is None:
                    self._end(lease, "closed")

    def take_released(self) -> list[list[int]]:
        """Block-id lists of leases that are over and unread, each returned exactly once."""
        with self._lock:
            out, self._released = self._released, []
            return out

    @property
    def num_active(self) -> int:
        """Leases still holding blocks (active, or ended while a read is in progress)."""
        with self._lock:
            return len(self._leases)

    def num_pending_release(self) -> int:
        with self._lock:
            return len(self._released)

    # ---- under the lock ---------------------------------------------------------------------
    def _live(self, transfer_id: str) -> Lease | None:
        lease = self._leases.get(transfer_id)
        if lease is None or lease.ended is not None:
            return None
        if self.clock() >= lease.expires_at:  # expired but not yet swept: refuse readers now
            self._end(lease, "expired")
            return None
        return lease

    def _evict_over_cap(self, keep: Lease) -> None:
        if self.max_blocks is None:
            return
        for lease in list(self._leases.values()):  # insertion order: oldest first
            if len(self._held) <= self.max_blocks:
                return
            # A lease being read is about to be acknowledged: ending it would free nothing now.
            if lease is not keep and lease.ended is None and lease.num_readers == 0:
                self._end(lease, "evicted")

    def _end(self, lease: Lease, reason: str) -> None:
        lease.ended = reason
        self.counts[reason] += 1
        self._release_if_done(lease)

    def _release_if_done(self, lease: Lease) -> None:
        if lease.ended is not None and lease.num_readers == 0:
            del self._leases[lease.transfer_id]
            for block_id in lease.block_ids:
                self._held[block_id] -= 1
                if not self._held[block_id]:
                    del self._held[block_id]
            self._released.append(lease.block_ids)

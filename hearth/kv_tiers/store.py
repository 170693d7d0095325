"""TieredStore: the engine's KVStore, over the tiers of hearth/kv_tiers/local.py (host
memory, a directory) or Mooncake Store (hearth/kv_tiers/mooncake_store.py).

    pool --evict--> staging buffer (memcpy, engine thread) --> writer thread --> tiers[0]
                                                             host (LRU) --overflow--> disk|shared
    admission --start_load--> loader threads: read record, check it, copy into the pool block
    waiting request --prefetch--> prefetch threads: read record, check it, hold it in host memory
                     admission --fill--> copy it into the pool block (engine thread, a memcpy)

Invariants:
  * every record is checked (hash, namespace, layout, length, crc32) before a byte reaches the
    pool; a copy that fails is dropped from its tier and the next tier is tried;
  * a load copies into the pool only under its state's lock, after checking it was not
    cancelled, so `cancel` returning means no write to its blocks follows;
  * nothing here blocks the engine thread on the store: `offload` is a memcpy or a drop,
    `contains` an index lookup (at most a stat, or a 50 ms-bounded Mooncake lookup), `fill` a
    memcpy of records already read; loads, prefetches and writes run on threads; a failing store
    (disk full, directory gone, corrupt files, a dead master) counts the error, drops the
    record and degrades to recompute;
  * a prefetched record is held for the waiting requests that asked for it (its owners) and
    leaves host memory when a load or `fill` takes it, or when its last owner is released;
    the prefetch table is touched only by the engine thread (the threads only read records).

A shared directory (several workers, one machine) is the directory tier with `shared`: a block
not in this worker's index is looked up on disk (another worker may have written it), and a
record deleted by another worker is just a miss.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import torch

from hearth.config import KVOffloadConfig
from hearth.kv_tiers.block_file import (HEADER, BlockRecordError, check_record, encode_header,
                                      record_bytes)
from hearth.kv_tiers.local import DirectoryTier, MemoryTier
from hearth.engine.kv.transfer_api import KVCacheGeometry
from hearth.engine.kv.store_api import LoadResult, StoreEvents

log = logging.getLogger("hearth.kv_tiers.store")

READ_AHEAD = 2  # blocks of one load read and checked at once (the copies stay in order)
PREFETCH_THREADS = 4  # reads of waiting requests' blocks in flight at once
OVERFLOW_FACTOR = 4  # staged blocks in flight at most: this many times max_pending_blocks


class _LoadState:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.cancelled = False
        self.num_loaded = 0


class _Prefetch:
    """One block being read (or read) into host memory for the waiting requests that want it."""

    __slots__ = ("future", "owners")

    def __init__(self, future) -> None:
        self.future = future  # of TieredStore._read: (tier, record, payload, error)
        self.owners: set[str] = set()

    def result(self):
        """(tier, record, payload) once read and checked; None while reading or if it failed."""
        f = self.future
        if not f.done() or f.cancelled() or f.exception() is not None:
            return None
        tier, record, payload, _ = f.result()
        return None if tier is None else (tier, record, payload)


class TieredStore:
    def __init__(self, config: KVOffloadConfig, kv_cache: torch.Tensor,
                 geometry: KVCacheGeometry, namespace: str) -> None:
        if kv_cache.dim() != 6 or kv_cache.shape[2] != geometry.num_blocks:
            raise ValueError("the KV tiers need the engine's local KV tensor")
        self.kv_cache = kv_cache
        self.geometry = geometry
        self.namespace = namespace
        self._events: list[tuple[str, int, str]] = []
        self._lock = threading.Lock()
        self.tiers: list = []
        if config.host_gb > 0:
            self.tiers.append(MemoryTier("host", int(config.host_gb * 2**30), self._event))
        if config.directory is not None:
            self.tiers.append(DirectoryTier(
                "shared" if config.shared else "disk", config.directory, namespace,
                int(config.max_gb * 2**30), config.shared, geometry, self._event))
        if config.mooncake_master is not None:
            if config.directory is not None:
                raise ValueError("kv offload: give --kv-offload-dir or a Mooncake Store, not both")
            from hearth.kv_tiers.mooncake_store import MooncakeTier
            host = config.mooncake_master.rpartition(":")[0]
            self.tiers.append(MooncakeTier(
                namespace, config.mooncake_master,
                config.mooncake_metadata or f"http://{host}:8080/metadata",
                int(config.mooncake_segment_gb * 2**30), self._event))
        if not self.tiers:
            raise ValueError("kv offload: give --kv-offload-dir or --kv-offload-host-gb")
        self.tier_names = tuple(t.name for t in self.tiers)
        # Staging: max_pending_blocks buffers kept; a burst of evictions (one big allocation
        # evicts a whole freed request, head last) may borrow up to OVERFLOW_FACTOR times more,
        # freed once written, so a burst costs memory for a moment rather than prefix heads.
        self._block_shape = (*kv_cache.shape[:2], *kv_cache.shape[3:])
        self._pin = kv_cache.device.type == "cuda"
        self._num_kept = max(1, config.max_pending_blocks)
        self._max_staged = self._num_kept * OVERFLOW_FACTOR
        self._free_staging = queue.SimpleQueue()
        for _ in range(self._num_kept):
            self._free_staging.put(self._new_staging())
        self._pending: set[int] = set()  # hashes copied to staging, not yet written
        self._writes: queue.SimpleQueue = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_loop, name="hearth-kv-offload",
                                        daemon=True)
        self._writer.start()
        self._loaders = ThreadPoolExecutor(max(1, config.num_load_threads),
                                           thread_name_prefix="hearth-kv-load")
        self._readers = ThreadPoolExecutor(READ_AHEAD, thread_name_prefix="hearth-kv-read")
        self._prefetchers = ThreadPoolExecutor(PREFETCH_THREADS,
                                               thread_name_prefix="hearth-kv-prefetch")
        self._prefetched: dict[int, _Prefetch] = {}  # block hash -> read ahead (engine thread)
        self._max_prefetched = max(0, config.max_prefetch_blocks)
        self._record_bytes = record_bytes(geometry)
        self._loads: dict[str, _LoadState] = {}
        self._done: list[LoadResult] = []
        self._done_event = threading.Event()
        self.counters = dict(queue_depth=0, writes_dropped=0, loads=0, load_seconds=0.0,
                             prefetched=0, prefetch_used=0, prefetch_unused=0)
        self._closed = False

    def _event(self, kind: str, block_hash: int, tier: str) -> None:
        with self._lock:
            self._events.append((kind, block_hash, tier))

    # ---- offload --------------------------------------------------------------------------
    def contains(self, block_hash: int) -> bool:
        return block_hash in self._pending or any(t.contains(block_hash) for t in self.tiers)

    def offload(self, block_hash: int, block_id: int) -> bool:
        if self._closed:
            return False
        try:
            staging = self._free_staging.get_nowait()
        except queue.Empty:
            if len(self._pending) >= self._max_staged:
                self.counters["writes_dropped"] += 1
                return False
            staging = self._new_staging()  # a burst: borrowed, freed once written
        staging.copy_(self.kv_cache[:, :, block_id])
        self._pending.add(block_hash)
        self.counters["queue_depth"] = len(self._pending)
        self._writes.put((block_hash, staging))
        return True

    def _new_staging(self) -> torch.Tensor:
        return torch.empty(self._block_shape, dtype=self.kv_cache.dtype, pin_memory=self._pin)

    def _write_loop(self) -> None:
        while True:
            item = self._writes.get()
            if item is None:
                return
            block_hash, staging = item
            try:
                payload = memoryview(staging.view(-1).view(torch.uint8).numpy())
                header = encode_header(self.namespace, block_hash, self.geometry, payload)
                self._put(0, block_hash, header, payload)
            except Exception:  # a bug here must not end the writer: the block is just lost
                log.exception("offload of block %016x failed", block_hash)
            finally:
                self._pending.discard(block_hash)
                self.counters["queue_depth"] = len(self._pending)
                if self._free_staging.qsize() < self._num_kept:
                    self._free_staging.put(staging)

    def _put(self, level: int, block_hash: int, header: bytes, payload: memoryview) -> None:
        tier = self.tiers[level]
        pushed_out = tier.put(block_hash, header, payload)
        if isinstance(tier, MemoryTier) and level + 1 < len(self.tiers):
            for old_hash, record in pushed_out:  # demote what the memory tier let go
                try:
                    self._put(level + 1, old_hash, record[:HEADER.size],
                              memoryview(record)[HEADER.size:])
                finally:
                    tier.left(old_hash)

    # ---- load -----------------------------------------------------------------------------
    def start_load(self, load_id: str, block_hashes: list[int], block_ids: list[int]) -> None:
        state = _LoadState()
        self._loads[load_id] = state
        # Reads already started by `prefetch` move to this load (it waits for them, on its thread).
        prefetched = [self._prefetched.pop(h, None) for h in block_hashes]
        prefetched = [p.future if p is not None else None for p in prefetched]
        self.counters["prefetch_used"] += sum(f is not None for f in prefetched)
        self._loaders.submit(self._load, load_id, state, list(block_hashes), list(block_ids),
                             prefetched)

    def _load(self, load_id: str, state: _LoadState, hashes: list[int],
              block_ids: list[int], prefetched: list) -> None:
        t0 = time.monotonic()
        result = LoadResult(load_id, 0)
        blocks = iter(zip(hashes, block_ids, prefetched))
        reads: deque = deque()  # (hash, block id, future of _read, prefetched?): READ_AHEAD ahead

        def read_next() -> None:
            item = next(blocks, None)
            if item is not None:
                block_hash, block_id, future = item
                reads.append((block_hash, block_id,
                              future or self._readers.submit(self._read, block_hash),
                              future is not None))
        try:
            for _ in range(READ_AHEAD):
                read_next()
            while reads:  # reads overlap; copies into the pool stay in order
                block_hash, block_id, future, was_prefetched = reads.popleft()
                read_next()
                tier, record, payload, error = future.result()
                if tier is None and was_prefetched:  # read too early (e.g. still being written)
                    tier, record, payload, error = self._read(block_hash)
                if tier is None:
                    result.error = error
                    break
                with state.lock:
                    if state.cancelled:
                        result.error = "cancelled"
                        break
                    self._copy_in(block_id, payload)
                    state.num_loaded += 1
                tier.counters["hits"] += 1
                tier.counters["bytes_read"] += len(record)
                result.tiers[tier.name] = result.tiers.get(tier.name, 0) + 1
                result.num_bytes += len(payload)
        except Exception as exc:  # never leave the engine waiting on a crashed load
            log.exception("KV load %s failed", load_id)
            result.error = f"{type(exc).__name__}: {exc}"
        result.num_loaded = state.num_loaded
        result.seconds = time.monotonic() - t0
        with self._lock:
            self._done.append(result)
            self._done_event.set()

    def _copy_in(self, block_id: int, payload: memoryview) -> None:
        block = torch.frombuffer(payload, dtype=torch.uint8).view(self.kv_cache.dtype)
        self.kv_cache[:, :, block_id].copy_(block.view(self._block_shape))

    # ---- prefetch (a waiting request's blocks, read into host memory before admission) ------
    def prefetch(self, owner: str, block_hashes: list[int]) -> int:
        """Start reading the leading `block_hashes` into host memory for `owner` (reads already
        started are shared). Stops at a block still being written or when the prefetch table
        is full; returns how many of the blocks are read or being read."""
        n = 0
        for block_hash in block_hashes:
            entry = self._prefetched.get(block_hash)
            if entry is not None and entry.future.done() and entry.result() is None:
                self._drop_prefetch(block_hash)  # its read failed: the record was dropped too
                break
            if entry is None:
                if (self._closed or block_hash in self._pending
                        or len(self._prefetched) >= self._max_prefetched):
                    break
                entry = _Prefetch(self._prefetchers.submit(self._read, block_hash))
                self._prefetched[block_hash] = entry
                self.counters["prefetched"] += 1
            entry.owners.add(owner)
            n += 1
        return n

    def ready(self, block_hashes: list[int]) -> int:
        """How many leading blocks are in host memory, read and checked (never waits)."""
        n = 0
        for block_hash in block_hashes:
            entry = self._prefetched.get(block_hash)
            if entry is None or entry.result() is None:
                break
            n += 1
        return n

    def fill(self, block_hashes: list[int], block_ids: list[int]) -> int:
        """Copy the leading blocks `ready` counts into pool blocks `block_ids` now (a memcpy
        each, on the caller's thread: no read happens here); they leave host memory."""
        n = 0
        for block_hash, block_id in zip(block_hashes, block_ids):
            entry = self._prefetched.get(block_hash)
            read = entry.result() if entry is not None else None
            if read is None:
                break
            tier, record, payload = read
            del self._prefetched[block_hash]
            self._copy_in(block_id, payload)
            tier.counters["hits"] += 1
            tier.counters["bytes_read"] += len(record)
            self.counters["prefetch_used"] += 1
            n += 1
        return n

    def release(self, owner: str) -> None:
        """`owner` no longer waits (admitted, finished or aborted): drop the reads only it
        wanted (a read in flight is cancelled or, once done, its buffer is let go)."""
        for block_hash, entry in list(self._prefetched.items()):
            entry.owners.discard(owner)
            if not entry.owners:
                self._drop_prefetch(block_hash)

    def _drop_prefetch(self, block_hash: int) -> None:
        entry = self._prefetched.pop(block_hash)
        entry.future.cancel()
        self.counters["prefetch_unused"] += 1

    @property
    def num_prefetched(self) -> int:
        """Blocks read or being read ahead, held in host memory for waiting requests."""
        return len(self._prefetched)

    def _read(self, block_hash: int):
        """(tier, record, payload, None) from the first tier holding a good copy, else
        (None, None, None, why). A copy failing its checks is dropped from its tier."""
        error = f"block {block_hash:016x} is in no tier any more"
        for tier in self.tiers:
            if not tier.contains(block_hash):
                continue
            try:
                record = tier.read(block_hash, torch.empty(self._record_bytes, dtype=torch.uint8))
                return tier, record, check_record(record, self.namespace, block_hash,
                                                  self.geometry), None
            except (OSError, BlockRecordError) as exc:
                if isinstance(exc, BlockRecordError):
                    tier.counters["corrupt"] += 1
                tier.discard(block_hash)
                self._event("evicted", block_hash, tier.name)
                error = f"{tier.name} block {block_hash:016x}: {exc}"
        return None, None, None, error

    def cancel(self, load_id: str) -> int:
        state = self._loads.pop(load_id, None)
        if state is None:
            return 0
        with state.lock:
            state.cancelled = True
            return state.num_loaded

    def poll(self) -> StoreEvents:
        with self._lock:
            done, self._done = self._done, []
            events, self._events = self._events, []
            self._done_event.clear()
        loads = []
        for result in done:
            if self._loads.pop(result.load_id, None) is not None:  # else cancelled before
                self.counters["loads"] += 1
                self.counters["load_seconds"] += result.seconds
                loads.append(result)
        return StoreEvents(loads, events)

    def wait(self, timeout: float) -> None:
        self._done_event.wait(timeout)

    def stats(self) -> dict[str, dict[str, float]]:
        out = {t.name: dict(t.counters) for t in self.tiers}
        out["offload"] = dict(self.counters, prefetch_held=len(self._prefetched))
        return out

    def close(self, timeout: float = 10.0) -> None:
        """Finish queued writes (up to `timeout`), stop the threads; never hangs on a dead disk."""
        if self._closed:
            return
        self._closed = True
        self._writes.put(None)
        self._writer.join(timeout)
        for load_id in list(self._loads):
            self.cancel(load_id)
        for block_hash in list(self._prefetched):
            self._drop_prefetch(block_hash)
        self._loaders.shutdown(wait=False, cancel_futures=True)
        self._readers.shutdown(wait=False, cancel_futures=True)
        self._prefetchers.shutdown(wait=False, cancel_futures=True)
        for tier in self.tiers:
            if hasattr(tier, "close"):
                tier.close()


def make_store(config: KVOffloadConfig, kv_cache: torch.Tensor, geometry: KVCacheGeometry,
               namespace: str) -> TieredStore:
    """The `StoreFactory` the engine-core process gives `LLMEngine`."""
    return TieredStore(config, kv_cache, geometry, namespace)

"""TieredStore: the engine's KVStore, over the tiers of hearth/kv_tiers/local.py (host
memory, a directory) or Mooncake Store (hearth/kv_tiers/mooncake_store.py).

    pool --evict--> staging buffer (memcpy, engine thread) --> writer thread --> tiers[0]
                                                             host (LRU) --overflow--> disk|shared
    admission --start_load--> loader threads: read record, check it, copy into the pool block

Invariants:
  * every record is checked (hash, namespace, layout, length, crc32) before a byte reaches the
    pool; a copy that fails is dropped from its tier and the next tier is tried;
  * a load copies into the pool only under its state's lock, after checking it was not
    cancelled, so `cancel` returning means no write to its blocks follows;
  * nothing here blocks the engine thread on the store: `offload` is a memcpy or a drop,
    `contains` an index lookup (at most a stat, or a 50 ms-bounded Mooncake lookup), loads and
    writes run on threads; a failing store (disk full, directory gone, corrupt files, a dead
    master) counts the error, drops the record and degrades to recompute.

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
OVERFLOW_FACTOR = 4  # staged blocks in flight at most: this many times max_pending_blocks


class _LoadState:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.cancelled = False
        self.num_loaded = 0


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
        self._record_bytes = record_bytes(geometry)
        self._loads: dict[str, _LoadState] = {}
        self._done: list[LoadResult] = []
        self._done_event = threading.Event()
        self.counters = dict(queue_depth=0, writes_dropped=0, loads=0, load_seconds=0.0)
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
        self._loaders.submit(self._load, load_id, state, list(block_hashes), list(block_ids))

    def _load(self, load_id: str, state: _LoadState, hashes: list[int],
              block_ids: list[int]) -> None:
        t0 = time.monotonic()
        result = LoadResult(load_id, 0)
        shape = (*self.kv_cache.shape[:2], *self.kv_cache.shape[3:])
        blocks = iter(zip(hashes, block_ids))
        reads: deque = deque()  # (block id, future of _read): the next READ_AHEAD blocks

        def read_next() -> None:
            item = next(blocks, None)
            if item is not None:
                reads.append((item[1], self._readers.submit(self._read, item[0])))
        try:
            for _ in range(READ_AHEAD):
                read_next()
            while reads:  # reads overlap; copies into the pool stay in order
                block_id, future = reads.popleft()
                read_next()
                tier, record, payload, error = future.result()
                if tier is None:
                    result.error = error
                    break
                block = torch.frombuffer(payload, dtype=torch.uint8).view(self.kv_cache.dtype)
                with state.lock:
                    if state.cancelled:
                        result.error = "cancelled"
                        break
                    self.kv_cache[:, :, block_id].copy_(block.view(shape))
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
        out["offload"] = dict(self.counters)
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
        self._loaders.shutdown(wait=False, cancel_futures=True)
        self._readers.shutdown(wait=False, cancel_futures=True)
        for tier in self.tiers:
            if hasattr(tier, "close"):
                tier.close()


def make_store(config: KVOffloadConfig, kv_cache: torch.Tensor, geometry: KVCacheGeometry,
               namespace: str) -> TieredStore:
    """The `StoreFactory` the engine-core process gives `LLMEngine`."""
    return TieredStore(config, kv_cache, geometry, namespace)

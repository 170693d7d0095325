"""The engine-side half of the KV tiers, driving a `KVStore` (see kv_store.py).

Invariants:
  * a block evicted from the pool is copied (or found already stored) before the pool hands it
    out again: the pool's `evict_listener` runs inside the eviction (with write-through, also
    when it enters the cache; a block dropped then is offered again at eviction);
  * a request whose prefix continues in a tier waits in `Scheduler.importing` like a PD import
    (WAITING_FOR_KV); its blocks are written only by its load, and freed or read by the model only
    after that load is reported done or cancelled (`complete_import` then frees an aborted one);
  * a slow, broken or absent store degrades to recompute: a load past its deadline is cancelled
    (no write follows), a failed block ends the load there, and the request computes the rest;
  * while a request waits in the queue, the tier blocks after its pool hits are read ahead into
    host memory (`prefetch`); if all of them are there when it is admitted, they are copied into
    its blocks right then (`fill`, a memcpy) and it runs in that same step, with no load and no
    WAITING_FOR_KV; else the load takes over the reads already in flight. What was read ahead
    for a request is released once it no longer waits (admitted, finished, aborted);
  * `num_cached_tokens` of a request counts its pool hits plus the tokens loaded from tiers.
"""

from __future__ import annotations

import hashlib
import logging
import time
from typing import Callable

from hearth.engine.kv.cache import KVCacheManager
from hearth.engine.kv.store_api import KVStore, LoadResult
from hearth.engine.request import Request
from hearth.engine.scheduler import Scheduler

log = logging.getLogger("hearth.engine.kv.tiers")

PREFETCH_RESCAN_SECONDS = 0.5  # a waiting request's tier blocks are looked up again this often


def store_namespace(model_config, geometry) -> str:
    """The store's key space for this model and KV layout: blocks are shared only between
    workers whose KV bytes for the same tokens are the same (same weights, formats and layout)."""
    g, m = geometry, model_config
    text = (f"{m.model}|{m.dtype}|{m.quantization}|{g.num_layers}|{g.block_size}|"
            f"{g.num_kv_heads}|{g.head_dim}|{g.dtype}" + ("" if g.num_planes == 2 else f"|{g.num_planes}"))
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


class KVTierDriver:
    def __init__(self, store: KVStore, scheduler: Scheduler, kv: KVCacheManager,
                 load_timeout_seconds: float, write_through: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`write_through`: also write each block when it is computed (a shared tier, so other
        workers find it before this pool evicts it), not only at eviction."""
        self.store = store
        self.scheduler = scheduler
        self.kv = kv
        self.load_timeout_seconds = load_timeout_seconds
        self.clock = clock
        self.loads: dict[str, tuple[Request, float, int]] = {}  # id -> (request, deadline, blocks)
        self._num_started = 0  # load ids are unique, so a late result never meets a newer load
        self.counters = dict(load_tokens=0, load_blocks=0, load_bytes=0, loads=0,
                             load_failures=0, load_timeouts=0, load_seconds=0.0, fills=0,
                             offloaded=0, offload_skipped=0, offload_dropped=0)
        # waiting request id -> when to look its tier blocks up again (it owns prefetched reads)
        self.prefetching: dict[str, float] = {}
        kv.pool.evict_listener = self._on_evict
        if write_through:
            kv.pool.cache_listener = self._on_evict  # the same copy, earlier
        scheduler.store_lookup = self.lookup
        scheduler.store_ready = self.ready
        scheduler.store_fill = self.fill

    # ---- offload (pool eviction) ----------------------------------------------------------
    def _on_evict(self, block_id: int, block_hash: int) -> None:
        if self.store.contains(block_hash):
            self.counters["offload_skipped"] += 1
        elif self.store.offload(block_hash, block_id):
            self.counters["offloaded"] += 1
        else:
            self.counters["offload_dropped"] += 1

    # ---- admission ------------------------------------------------------------------------
    def lookup(self, req: Request, num_pool_hits: int) -> int:
        """How many blocks after the pool's hits a tier holds (leaving >= 1 token to compute)."""
        max_blocks = (req.num_tokens - 1) // self.kv.block_size
        hashes = self.kv.update_block_hashes(req)[:max_blocks]
        n = 0
        for block_hash in hashes[num_pool_hits:]:
            if not self.store.contains(block_hash):
                break
            n += 1
        return n

    def ready(self, req: Request, num_pool_hits: int, num_blocks: int) -> bool:
        """Whether the `num_blocks` tier blocks after the pool's hits are all in host memory."""
        hashes = req.block_hashes[num_pool_hits:num_pool_hits + num_blocks]
        return self.store.ready(hashes) == num_blocks

    def fill(self, req: Request, num_pool_hits: int, num_blocks: int) -> int:
        """Copy those blocks (read ahead) into the request's blocks now; returns how many."""
        t0 = time.monotonic()
        positions = range(num_pool_hits, num_pool_hits + num_blocks)
        n = self.store.fill([req.block_hashes[i] for i in positions],
                            [req.block_ids[i] for i in positions])
        c = self.counters
        c["fills"] += 1
        c["load_blocks"] += n
        c["load_tokens"] += n * self.kv.block_size
        c["load_seconds"] += time.monotonic() - t0
        if n < num_blocks:
            c["load_failures"] += 1
        if req.num_preemptions == 0:
            req.num_cached_tokens += n * self.kv.block_size
        return n

    def prefetch_waiting(self) -> None:
        """Read ahead the tier blocks of waiting requests, in queue order while the store's
        table has room (each looked up again every PREFETCH_RESCAN_SECONDS: pool hits may have
        been evicted meanwhile); release what requests that no longer wait had asked for."""
        now = self.clock()
        waiting = {}
        for req in self.scheduler.waiting:
            rid = req.request_id
            if req.kv_import is not None:
                continue
            if self.prefetching.get(rid, now) > now:
                waiting[rid] = self.prefetching[rid]
                continue
            num_hits = len(self.kv.find_cached_prefix(req))
            num_stored = self.lookup(req, num_hits)
            if num_stored:
                self.store.prefetch(rid, req.block_hashes[num_hits:num_hits + num_stored])
            waiting[rid] = now + PREFETCH_RESCAN_SECONDS
        for rid in self.prefetching.keys() - waiting.keys():
            self.store.release(rid)
        self.prefetching = waiting

    def start_loads(self, reqs: list[Request]) -> None:
        for req in reqs:
            first = req.num_computed_tokens // self.kv.block_size  # after the pool's hits
            positions = range(first, len(req.block_ids))
            hashes = [req.block_hashes[i] for i in positions]
            block_ids = [req.block_ids[i] for i in positions]
            self._num_started += 1
            load_id = f"{req.request_id}#{self._num_started}"
            self.loads[load_id] = (req, self.clock() + self.load_timeout_seconds, len(block_ids))
            try:
                self.store.start_load(load_id, hashes, block_ids)
            except Exception as exc:  # nothing was started: recompute instead
                log.exception("could not start the KV load of %s", req.request_id)
                self._complete(LoadResult(load_id, 0, error=str(exc)))

    # ---- engine loop ----------------------------------------------------------------------
    def poll(self) -> None:
        """Resume requests whose loads ended; cancel the ones past their deadline; read ahead
        for the waiting ones."""
        events = self.store.poll()
        for kind, block_hash, tier in events.block_events:
            self.kv.pool.record_tier_event(kind, block_hash, tier)
        for result in events.loads:
            if result.load_id in self.loads:  # else: cancelled before, already completed
                self._complete(result)
        now = self.clock()
        for load_id, (req, deadline, _) in list(self.loads.items()):
            if now >= deadline:
                self.counters["load_timeouts"] += 1
                num_loaded = self.store.cancel(load_id)
                self._complete(LoadResult(load_id, num_loaded, error="timed out"))
        self.prefetch_waiting()

    def _complete(self, result: LoadResult) -> None:
        req, _, num_wanted = self.loads.pop(result.load_id)
        num_tokens = result.num_loaded * self.kv.block_size
        c = self.counters
        c["loads"] += 1
        c["load_blocks"] += result.num_loaded
        c["load_tokens"] += num_tokens
        c["load_bytes"] += result.num_bytes
        c["load_seconds"] += result.seconds
        if result.num_loaded < num_wanted:
            c["load_failures"] += 1
            log.warning("KV load of %s stopped after %d of %d blocks (%s); recomputing the rest",
                        req.request_id, result.num_loaded, num_wanted, result.error)
        if req.num_preemptions == 0:  # a re-admitted request counted its cached prefix before
            req.num_cached_tokens += num_tokens
        self.scheduler.complete_import(req, req.num_computed_tokens + num_tokens)
        if not req.is_finished:
            self.kv.register_computed_blocks(req)

    def wait(self, timeout: float) -> None:
        """Called when a step had nothing to compute: sleep until a load may be done."""
        if self.loads:
            self.store.wait(min(timeout, self.load_timeout_seconds))

    @property
    def num_loading(self) -> int:
        return len(self.loads)

    def stats(self) -> dict[str, dict[str, float]]:
        out = self.store.stats()
        out.setdefault("offload", {}).update(self.counters)
        return out

    def close(self) -> None:
        for rid in self.prefetching:
            self.store.release(rid)
        self.prefetching = {}
        for load_id in list(self.loads):
            self._complete(LoadResult(load_id, self.store.cancel(load_id), error="closed"))
        self.store.close()

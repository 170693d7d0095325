"""A KV tier in Mooncake Store: one object per block, shared by every worker of one cluster.

Mooncake Store (the `mooncake` package's `MooncakeDistributedStore`) is a distributed object
store: a `mooncake_master` keeps the index, and each client contributes a memory segment that
holds objects. Every worker of a cluster sees every object, on any machine, so this tier plays
the role of the shared directory across machines (its tier name is "mooncake").

Keys are `hearth/<namespace>/<block hash as 16 hex>`; values are the same checked records as
the directory tier's files (hearth/kv_tiers/block_file.py), so a record is loaded only if its hash,
namespace, layout and crc32 match. The store evicts objects on its own (its lease and its
segments' sizes) and says nothing: a block the router still believes there is a miss on load,
and the request recomputes.

Every call here is a synchronous RPC to the master or a peer; they run on the store's writer and
loader threads, except `contains`, which the engine thread calls at admission and eviction: it
answers from the keys this worker wrote or found first, and asks the master only for the rest,
on a helper thread it waits for at most LOOKUP_TIMEOUT_S (a master that is down or reconnecting
can block a call for seconds): past that, or while an earlier lookup is still stuck, the answer
is a miss, and the master is not asked again for DOWN_SECONDS. Writes keep to the same window: a
put that fails after waiting SLOW_FAILURE_S or more (a timeout: the master is slow or gone; a
quick refusal, such as a key another worker wrote first, is not one) marks the master down, and
a put inside the window is dropped at once (a write error) instead of waiting out the client's
~4-8 s timeout, so a dead master cannot back up the writer thread (nor hold a shutdown for a
timeout per queued block).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import torch

log = logging.getLogger("hearth.kv_tiers.mooncake_store")

LOOKUP_TIMEOUT_S = 0.05
DOWN_SECONDS = 5.0
SLOW_FAILURE_S = 1.0


def mooncake_available() -> bool:
    try:
        from mooncake.store import MooncakeDistributedStore  # noqa: F401
    except ImportError:
        return False
    return True


class MooncakeTier:
    def __init__(self, namespace: str, master: str, metadata: str, segment_bytes: int,
                 on_event, local_hostname: str = "127.0.0.1") -> None:
        from mooncake.store import MooncakeDistributedStore

        from hearth.kv_tiers.local import tier_counters

        self.name = "mooncake"
        self.prefix = f"hearth/{namespace}/"
        self.on_event = on_event
        self.counters = tier_counters()
        self._known: set[int] = set()  # written or seen here (the store may still evict them)
        self._lock = threading.Lock()
        self._lookups = ThreadPoolExecutor(1, thread_name_prefix="hearth-mooncake-lookup")
        self._pending: Future | None = None
        self._down_until = 0.0
        self.store = MooncakeDistributedStore()
        rc = self.store.setup(local_hostname, metadata, segment_bytes, min(segment_bytes, 64 << 20),
                              "tcp", "", master)
        if rc != 0:
            raise ValueError(f"kv offload: Mooncake Store setup failed (code {rc}) with master "
                             f"{master} and metadata {metadata}")

    def _key(self, block_hash: int) -> str:
        return f"{self.prefix}{block_hash:016x}"

    def contains(self, block_hash: int) -> bool:
        if block_hash in self._known:
            return True
        now = time.monotonic()
        if now < self._down_until or (self._pending is not None and not self._pending.done()):
            return False
        self._pending = self._lookups.submit(self.store.is_exist, self._key(block_hash))
        try:
            found = self._pending.result(timeout=LOOKUP_TIMEOUT_S) == 1
        except FutureTimeout:  # the master is slow or gone: a miss, and leave it alone a while
            self._down_until = now + DOWN_SECONDS
            self.counters["lookup_timeouts"] = self.counters.get("lookup_timeouts", 0) + 1
            return False
        except Exception:
            return False
        if found:
            with self._lock:
                self._known.add(block_hash)
        return found

    def put(self, block_hash: int, header: bytes, payload: memoryview) -> bool:
        if time.monotonic() < self._down_until:
            self.counters["write_errors"] += 1
            return False
        start = time.monotonic()
        try:
            rc = self.store.put(self._key(block_hash), bytes(header) + bytes(payload))
        except Exception as exc:
            rc = exc
        if rc != 0:
            self.counters["write_errors"] += 1
            if time.monotonic() - start >= SLOW_FAILURE_S:
                self._down_until = time.monotonic() + DOWN_SECONDS
                log.warning("mooncake tier: could not put block %016x: %s (not writing for "
                            "%.0f s)", block_hash, rc, DOWN_SECONDS)
            else:
                log.warning("mooncake tier: could not put block %016x: %s", block_hash, rc)
            return False
        with self._lock:
            self._known.add(block_hash)
            self.counters["num_blocks"] = len(self._known)
            self.counters["num_bytes"] += len(header) + len(payload)
        self.counters["stored"] += 1
        self.counters["bytes_written"] += len(header) + len(payload)
        self.on_event("stored", block_hash, self.name)
        return True

    def read(self, block_hash: int, buffer: torch.Tensor) -> memoryview:
        data = self.store.get(self._key(block_hash))
        if not data:
            raise FileNotFoundError(f"block {block_hash:016x} is not in Mooncake Store")
        view = memoryview(buffer.numpy())
        n = min(len(data), len(view))
        view[:n] = data[:n]
        if len(data) > len(view):
            from hearth.kv_tiers.block_file import BlockRecordError
            raise BlockRecordError("object is longer than a record")
        return view[:n]

    def discard(self, block_hash: int) -> None:
        with self._lock:
            self._known.discard(block_hash)
            self.counters["num_blocks"] = len(self._known)
        try:
            self.store.remove(self._key(block_hash))  # refused under the object's lease: fine
        except Exception:
            pass

    def close(self) -> None:
        self._lookups.shutdown(wait=False, cancel_futures=True)
        try:
            self.store.close()
        except Exception:
            pass

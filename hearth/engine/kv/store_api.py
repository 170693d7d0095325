"""The KV-store interface: what the engine needs from the tiers below its block pool.

The engine never imports `hearth.kv_tiers`; the engine-core process hands it a factory that builds
an object with this interface (`hearth.kv_tiers.store.TieredStore`). As with the KV connector,
every call comes from the engine's thread; the store's own threads talk back only through `poll`.

Keys are the chained block hashes of the prefix cache (`hearth.engine.kv.block_hash`), so a block is
found in a tier exactly when the pool would have found it: same tokens, same prefix. A store is
bound to one model and KV layout (its `namespace`): blocks of another model are never seen.

    pool eviction --offload(hash, block_id)--> staging copy (now) --> tier write (store thread)
    admission     --lookup(hashes)--> n leading hashes held --> start_load(...) (store thread)
                  <--poll()-- LoadResult: the first num_loaded blocks are in the pool now
    waiting       --prefetch(owner, hashes)--> read into host memory (store threads)
    admission     --ready(hashes) == n--> fill(hashes, block_ids): copied in now, no load
                  --release(owner)--> what only that request wanted leaves host memory
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol

if TYPE_CHECKING:
    import torch

    from hearth.engine.kv.transfer_api import KVCacheGeometry


@dataclass
class LoadResult:
    """One finished load, reported by `poll`. Blocks past `num_loaded` were never written."""

    load_id: str
    num_loaded: int  # leading blocks now in the pool, verified (hash, layout, checksum)
    num_bytes: int = 0
    seconds: float = 0.0
    tiers: dict[str, int] = field(default_factory=dict)  # tier name -> blocks loaded from it
    error: str | None = None  # why it stopped before the last block (None: all loaded)


@dataclass
class StoreEvents:
    loads: list[LoadResult] = field(default_factory=list)
    # (kind "stored" | "evicted", block hash, tier name), for the router's cache view
    block_events: list[tuple[str, int, str]] = field(default_factory=list)


class KVStore(Protocol):
    tier_names: tuple[str, ...]  # top first, e.g. ("host", "disk") or ("shared",)

    def contains(self, block_hash: int) -> bool:
        """Whether some tier holds the block or a write of it is pending (fast: an index,
        at most a stat)."""

    def offload(self, block_hash: int, block_id: int) -> bool:
        """Copy pool block `block_id` now (it is reused right after this returns) and write it
        under `block_hash` in the background. False: dropped (every staging buffer is busy)."""

    def start_load(self, load_id: str, block_hashes: list[int], block_ids: list[int]) -> None:
        """In the background, fill pool block `block_ids[i]` with the block stored under
        `block_hashes[i]`, in order, stopping at the first one missing or failing checks."""

    def prefetch(self, owner: str, block_hashes: list[int]) -> int:
        """Start reading the leading blocks into host memory for `owner` (a waiting request),
        in the background; a later `start_load` of them waits for these reads instead of
        starting its own. Returns how many are read or being read (a bounded table)."""

    def ready(self, block_hashes: list[int]) -> int:
        """How many leading blocks are in host memory, read and checked (never waits)."""

    def fill(self, block_hashes: list[int], block_ids: list[int]) -> int:
        """Copy the leading blocks `ready` counts into pool blocks `block_ids` now (no I/O);
        returns how many were copied."""

    def release(self, owner: str) -> None:
        """`owner` waits no more: drop what was read ahead for it alone."""

    def cancel(self, load_id: str) -> int:
        """End a load now: no write to its blocks follows this call. Returns the blocks written
        (its result, if it comes later, is dropped by `poll`)."""

    def poll(self) -> StoreEvents:
        """What the store threads finished since the last call (never blocks)."""

    def wait(self, timeout: float) -> None:
        """Block up to `timeout` seconds until a load may have finished."""

    def stats(self) -> dict[str, dict[str, float]]:
        """tier name -> counters (hits, bytes, stored, evicted, errors, ...) and the store's own
        ("offload": queue depth, dropped, load latency sums)."""

    def close(self) -> None:
        """Stop the store threads (pending writes are finished or dropped, never torn)."""


# Built by the engine once its KV tensor exists:
# factory(kv_offload_config, kv_cache, geometry, namespace).
StoreFactory = Callable[[object, "torch.Tensor", "KVCacheGeometry", str], KVStore]

"""The KV block pool: reference counts, a free queue in eviction order, and the prefix cache.

Invariants (checked by `check_integrity`):
  * a block is in the free queue  <=>  its ref_count is 0;
  * a block with a hash is in `cached` under that hash, and `cached` holds nothing else;
  * the free queue's front is evicted first: freed blocks are appended at the back, so the least
    recently freed block is reused first (LRU). A free block keeps its hash (and so stays a prefix-
    cache hit) until it is handed out again.

The pool knows nothing about requests: it takes and returns block ids and hashes. An
`evict_listener(block_id, block_hash)` (the KV tiers) is called while an evicted block still holds
its bytes, before it is handed out again; it must copy what it keeps before returning. A
`cache_listener(block_id, block_hash)` is called when a computed block enters the cache (a
shared tier writes blocks through, so other workers see them before this pool evicts them).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Callable


class Block:
    __slots__ = ("block_id", "ref_count", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: int | None = None

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_count}, hash={self.block_hash})"


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True, max_events: int = 65536):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[int, Block] = {}
        # Stored/evicted hash events for the router's cache view: (seq, "stored"|"evicted", hash).
        self.events: deque[tuple[int, str, int]] = deque(maxlen=max_events)
        # The same reports for the tiers below the pool: (seq, kind, hash, tier name).
        self.tier_events: deque[tuple[int, str, int, str]] = deque(maxlen=max_events)
        self.event_seq = 0
        self.evict_listener: Callable[[int, int], None] | None = None
        self.cache_listener: Callable[[int, int], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def get_cached(self, block_hash: int) -> Block | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def num_reclaimable(self, blocks: list[Block]) -> int:
        """How many of `blocks` are sitting in the free queue (touching them uses up free blocks)."""
        return sum(1 for b in blocks if b.ref_count == 0)

    def touch(self, blocks: list[Block]) -> None:
        """Take a reference on cached blocks (prefix hits), pulling free ones out of the queue."""
        for block in blocks:
            if block.ref_count == 0:
                del self.free_queue[block.block_id]
            block.ref_count += 1

    def allocate(self, num_blocks: int) -> list[Block]:
        if num_blocks > len(self.free_queue):
            raise RuntimeError(f"cannot allocate {num_blocks} blocks, {len(self.free_queue)} free")
        out = []
        for _ in range(num_blocks):
            _, block = self.free_queue.popitem(last=False)
            self._evict(block)
            block.ref_count = 1
            out.append(block)
        return out

    def free(self, blocks: list[Block]) -> None:
        """Drop one reference from each block; pass them in the order they should be evicted."""
        for block in blocks:
            if block.ref_count <= 0:
                raise RuntimeError(f"double free of {block}")
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block.block_id] = block

    def cache(self, block: Block, block_hash: int) -> None:
        """Register a fully computed block under its hash (first writer wins on duplicates)."""
        if not self.enable_caching or block.block_hash is not None or block_hash in self.cached:
            return
        block.block_hash = block_hash
        self.cached[block_hash] = block
        self._event("stored", block_hash)
        if self.cache_listener is not None:
            self.cache_listener(block.block_id, block_hash)

    def reset_cache(self) -> int:
        """Forget every hash of a free block; returns how many were dropped."""
        dropped = 0
        for block in self.free_queue.values():
            if block.block_hash is not None:
                self._evict(block)
                dropped += 1
        return dropped

    def _evict(self, block: Block) -> None:
        if block.block_hash is not None:
            if self.evict_listener is not None:
                self.evict_listener(block.block_id, block.block_hash)
            del self.cached[block.block_hash]
            self._event("evicted", block.block_hash)
            block.block_hash = None

    def _event(self, kind: str, block_hash: int) -> None:
        self.event_seq += 1
        self.events.append((self.event_seq, kind, block_hash))

    def events_since(self, cursor: int) -> tuple[int, list[int], list[int]]:
        """(new cursor, stored hashes, evicted hashes) after `cursor`; a lost window returns all."""
        stored, evicted = [], []
        for seq, kind, block_hash in self.events:
            if seq > cursor:
                (stored if kind == "stored" else evicted).append(block_hash)
        return self.event_seq, stored, evicted

    def record_tier_event(self, kind: str, block_hash: int, tier: str) -> None:
        """A lower tier stored or evicted a block (reported with the pool's own events)."""
        self.event_seq += 1
        self.tier_events.append((self.event_seq, kind, block_hash, tier))

    def tier_events_since(self, cursor: int) -> dict[str, tuple[list[int], list[int]]]:
        """tier -> (stored, evicted) after `cursor` (the cursor of `events_since`)."""
        out: dict[str, tuple[list[int], list[int]]] = {}
        for seq, kind, block_hash, tier in self.tier_events:
            if seq > cursor:
                stored, evicted = out.setdefault(tier, ([], []))
                (stored if kind == "stored" else evicted).append(block_hash)
        return out

    def is_whole(self) -> bool:
        """No block is referenced: everything is free (possibly still cached)."""
        return len(self.free_queue) == self.num_blocks

    def check_integrity(self) -> None:
        for block in self.blocks:
            in_queue = block.block_id in self.free_queue
            assert in_queue == (block.ref_count == 0), f"{block}: queue={in_queue}"
            assert block.ref_count >= 0, block
            if block.block_hash is not None:
                assert self.cached.get(block.block_hash) is block, f"{block} not in cache map"
        for block_hash, block in self.cached.items():
            assert block.block_hash == block_hash, f"cache map entry {block_hash} -> {block}"
        assert len(self.free_queue) <= self.num_blocks

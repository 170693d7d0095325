"""KV cache manager: maps requests onto pool blocks and owns prefix-cache bookkeeping.

For a request, `block_ids[i]` holds the KV of tokens [i * block_size, (i + 1) * block_size).
Full, computed blocks are entered into the prefix cache under their chained hash, so a later
request with the same prefix reuses them. A cache hit never covers the whole request: at least one
token is always left to compute, because the engine needs its logits.
"""

from __future__ import annotations

from hearth.engine.kv.block_hash import ROOT_HASH, hash_blocks
from hearth.engine.kv.block_pool import Block, BlockPool
from hearth.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def update_block_hashes(self, request: Request) -> list[int]:
        """Extend `request.block_hashes` to cover every full block of its tokens."""
        num_full = request.num_tokens // self.block_size
        have = len(request.block_hashes)
        if num_full > have:
            parent = request.block_hashes[-1] if have else ROOT_HASH
            request.block_hashes.extend(
                hash_blocks(request.all_token_ids[: num_full * self.block_size], self.block_size,
                            parent, start_block=have)
            )
        return request.block_hashes

    def find_cached_prefix(self, request: Request) -> list[Block]:
        """The longest run of cached blocks at the start of the request (leaving >= 1 token)."""
        if not self.pool.enable_caching:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for block_hash in self.update_block_hashes(request)[:max_blocks]:
            block = self.pool.get_cached(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def can_allocate(self, request: Request, num_new_tokens: int, hits: list[Block] = ()) -> bool:
        return self._num_blocks_needed(request, num_new_tokens, hits) <= (
            self.pool.num_free_blocks - self.pool.num_reclaimable(list(hits))
        )

    def allocate(self, request: Request, num_new_tokens: int, hits: list[Block] = ()) -> bool:
        """Give the request blocks for `num_new_tokens` more tokens; with `hits` (first schedule
        of a waiting request) the cached prefix is adopted first. False if the pool is short."""
        if not self.can_allocate(request, num_new_tokens, hits):
            return False
        if hits:
            assert not request.block_ids, "prefix hits are adopted only by a fresh request"
            self.pool.touch(hits)
            request.block_ids = [b.block_id for b in hits]
            request.num_computed_tokens = len(hits) * self.block_size
            request.num_registered_blocks = len(hits)
        needed = self._num_blocks_needed(request, num_new_tokens, ())
        request.block_ids.extend(b.block_id for b in self.pool.allocate(needed))
        return True

    def _num_blocks_needed(self, request: Request, num_new_tokens: int, hits) -> int:
        num_computed = len(hits) * self.block_size if hits else request.num_computed_tokens
        have = len(hits) if hits else len(request.block_ids)
        return max(0, cdiv(num_computed + num_new_tokens, self.block_size) - have)

    def register_computed_blocks(self, request: Request) -> None:
        """Enter newly completed full blocks of the request into the prefix cache."""
        num_full = request.num_computed_tokens // self.block_size
        if num_full <= request.num_registered_blocks:
            return
        hashes = self.update_block_hashes(request)
        for i in range(request.num_registered_blocks, min(num_full, len(hashes))):
            self.pool.cache(self.pool.blocks[request.block_ids[i]], hashes[i])
        request.num_registered_blocks = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks; its tail is evicted before its (more shareable) head."""
        self.free_block_ids(self.detach(request))

    def detach(self, request: Request) -> list[int]:
        """Take the request's block references away from it (a KV export keeps them leased)."""
        block_ids, request.block_ids = request.block_ids, []
        request.num_registered_blocks = 0
        return block_ids

    def free_block_ids(self, block_ids: list[int]) -> None:
        """Drop one reference on each block (tail first, as in `free`)."""
        self.pool.free([self.pool.blocks[i] for i in reversed(block_ids)])

    def usage(self) -> float:
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

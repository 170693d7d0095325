"""The block-hash function shared by the engine's prefix cache and the router.

A block's hash covers its own token ids and, through `parent_hash`, every token before it, so two
requests share a block hash exactly when they share the whole prefix up to the end of that block.
The hash is stable across processes and machines (no Python `hash()` randomisation): the router
computes the same values from token ids and compares them with what workers report.
"""

from __future__ import annotations

import hashlib
import struct

ROOT_HASH = 0


def hash_block(parent_hash: int, token_ids: list[int] | tuple[int, ...]) -> int:
    h = hashlib.blake2b(digest_size=8)
    h.update(struct.pack("<Q", parent_hash))
    h.update(struct.pack(f"<{len(token_ids)}i", *token_ids))
    return int.from_bytes(h.digest(), "little")


def hash_blocks(
    token_ids: list[int], block_size: int, parent_hash: int = ROOT_HASH, start_block: int = 0
) -> list[int]:
    """Chained hashes of the full blocks of `token_ids`, starting at block index `start_block`."""
    hashes = []
    for start in range(start_block * block_size, len(token_ids) - block_size + 1, block_size):
        parent_hash = hash_block(parent_hash, token_ids[start : start + block_size])
        hashes.append(parent_hash)
    return hashes

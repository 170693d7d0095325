"""Byte-level access to a KV tensor's blocks, for the transports.

The KV tensor is `[num_layers, planes, num_blocks, block_size, heads, dim]` (planes: K and V, or
MLA's one latent plane), contiguous, so one block is `planes * num_layers` separate chunks, and
consecutive block ids are adjacent within a plane:

    plane p = (layer, K|V):  | blk 0 | blk 1 | blk 2 | ... |    chunk = block_size*heads*dim*itemsize
    byte offset of (p, b) = (p * num_blocks + b) * chunk

A list of blocks is moved plane by plane, each plane's blocks in list order; runs of consecutive
ids become one buffer, so a transfer of n blocks is at most planes * num_layers * n buffers.
"""

from __future__ import annotations

import torch


def coalesce(block_ids: list[int]) -> list[tuple[int, int]]:
    """Runs of consecutive ids as (first id, count), in order: [4, 5, 6, 9] -> [(4, 3), (9, 1)]."""
    runs: list[tuple[int, int]] = []
    for block_id in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == block_id:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((block_id, 1))
    return runs


def coalesce_pairs(src_ids: list[int], dst_ids: list[int]) -> list[tuple[int, int, int]]:
    """Runs consecutive on both sides as (src first, dst first, count)."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_ids, dst_ids):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


class KVMemory:
    def __init__(self, kv_cache: torch.Tensor) -> None:
        if kv_cache.device.type != "cpu" or not kv_cache.is_contiguous():
            raise ValueError("the KV transfer needs a contiguous CPU KV tensor")
        num_layers, planes, num_blocks = kv_cache.shape[:3]
        self.tensor = kv_cache  # keeps the memory alive while views of it exist
        self.num_planes = num_layers * planes
        self.num_blocks = num_blocks
        self.chunk_bytes = kv_cache[0, 0, 0].numel() * kv_cache.element_size()
        self.bytes_per_block = self.num_planes * self.chunk_bytes
        self.base_address = kv_cache.data_ptr()
        self.num_bytes = kv_cache.numel() * kv_cache.element_size()
        self.view = memoryview(kv_cache.view(-1).view(torch.uint8).numpy())

    def buffers(self, block_ids: list[int]) -> list[memoryview]:
        """Writable views of the blocks, in wire order (plane-major, then list order)."""
        runs = coalesce(block_ids)
        out = []
        for plane in range(self.num_planes):
            for first, count in runs:
                offset = (plane * self.num_blocks + first) * self.chunk_bytes
                out.append(self.view[offset: offset + count * self.chunk_bytes])
        return out

    def address(self, plane: int, block_id: int) -> int:
        return self.base_address + (plane * self.num_blocks + block_id) * self.chunk_bytes

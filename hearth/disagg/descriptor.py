"""The KV descriptor: what a prefill worker tells a decode worker about the KV it holds.

It travels as JSON (router -> decode worker) and is checked on arrival: a decode worker pulls
only from a descriptor whose geometry equals its own and whose block hashes equal the hashes of
the prompt it was given, so it can never splice another prompt's KV into a request.
"""

from __future__ import annotations

import msgspec

from hearth.engine.block_hash import ROOT_HASH, hash_block, hash_blocks
from hearth.engine.connector import KVCacheGeometry
from hearth.engine.kv_cache import cdiv

DESCRIPTOR_VERSION = 1
MAX_TRANSFER_ID_BYTES = 64  # it fills a fixed field of the wire header


class KVDescriptor(msgspec.Struct, frozen=True, kw_only=True):
    version: int  # DESCRIPTOR_VERSION of the writer; a reader refuses any other
    transfer_id: str  # the lease key the router chose for the prefill hop
    transport: str  # "tcp" | "mooncake": how the decode side moves the bytes
    host: str  # the prefill worker's transfer server (lease control, and data for tcp)
    port: int
    num_tokens: int  # prompt tokens whose KV the blocks hold (the whole prompt)
    block_size: int  # tokens per block
    block_ids: list[int]  # prefill-side block ids in token order: cdiv(num_tokens, block_size)
    block_hashes: list[int]  # chained hashes of the full blocks: num_tokens // block_size
    tokens_hash: int  # the chain continued over the partial last block: covers every token
    num_layers: int  # KV geometry: [num_layers, 2, *, block_size, num_kv_heads, head_dim]
    num_kv_heads: int
    head_dim: int
    dtype: str  # "float32" | "bfloat16" | "float16"
    bytes_per_block: int  # 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize
    expires_at: float  # unix time at which the lease ends (prefill clock; a hint for the reader)
    mooncake_session: str = ""  # mooncake: "host:port" of the prefill's transfer engine
    mooncake_base_address: int = 0  # mooncake: address of the prefill KV tensor
    mooncake_num_blocks: int = 0  # mooncake: blocks in the prefill KV tensor (plane stride)

    def geometry_key(self) -> tuple:
        return (self.block_size, self.num_layers, self.num_kv_heads, self.head_dim, self.dtype,
                self.bytes_per_block)


def geometry_key(geometry: KVCacheGeometry) -> tuple:
    return (geometry.block_size, geometry.num_layers, geometry.num_kv_heads, geometry.head_dim,
            geometry.dtype, geometry.bytes_per_block)


def descriptor_to_json(descriptor: KVDescriptor) -> dict:
    return msgspec.to_builtins(descriptor)


def descriptor_from_json(obj: object) -> KVDescriptor:
    """Parse and check internal consistency; ValueError names what is wrong."""
    try:
        d = msgspec.convert(obj, KVDescriptor)
    except msgspec.ValidationError as exc:
        raise ValueError(f"kv_transfer.descriptor: {exc}") from None
    if d.version != DESCRIPTOR_VERSION:
        raise ValueError(f"kv_transfer.descriptor.version: {d.version} is not supported "
                         f"(this worker speaks {DESCRIPTOR_VERSION})")
    check_transfer_id(d.transfer_id)
    if d.num_tokens < 1 or d.block_size < 1:
        raise ValueError("kv_transfer.descriptor: num_tokens and block_size must be >= 1")
    if len(d.block_ids) != cdiv(d.num_tokens, d.block_size):
        raise ValueError(f"kv_transfer.descriptor.block_ids: {len(d.block_ids)} blocks cannot "
                         f"hold {d.num_tokens} tokens of {d.block_size}")
    if len(d.block_hashes) != d.num_tokens // d.block_size:
        raise ValueError("kv_transfer.descriptor.block_hashes: one hash per full block expected")
    if not 0 < d.port < 65536:
        raise ValueError(f"kv_transfer.descriptor.port: {d.port} is not a port")
    return d


def check_transfer_id(transfer_id: object) -> None:
    if not isinstance(transfer_id, str) or not transfer_id:
        raise ValueError("kv_transfer.transfer_id: must be a non-empty string")
    if len(transfer_id.encode()) > MAX_TRANSFER_ID_BYTES or "\0" in transfer_id:
        raise ValueError(f"kv_transfer.transfer_id: at most {MAX_TRANSFER_ID_BYTES} bytes of "
                         f"UTF-8 without NUL")


def check_against(d: KVDescriptor, geometry: KVCacheGeometry, prompt_token_ids: list[int]) -> None:
    """The descriptor must describe this prompt's KV in this worker's layout."""
    if d.geometry_key() != geometry_key(geometry):
        raise ValueError(f"kv_transfer.descriptor: KV layout {d.geometry_key()} differs from this "
                         f"worker's {geometry_key(geometry)} (same model, dtype and block size "
                         f"are required)")
    if d.num_tokens != len(prompt_token_ids):
        raise ValueError(f"kv_transfer.descriptor.num_tokens: {d.num_tokens}, but the prompt has "
                         f"{len(prompt_token_ids)} tokens")
    hashes = hash_blocks(prompt_token_ids, d.block_size)
    full = tokens_hash(prompt_token_ids, hashes, d.block_size)
    if hashes != d.block_hashes or full != d.tokens_hash:
        raise ValueError("kv_transfer.descriptor: its hashes do not match the prompt's tokens "
                         "(the KV belongs to another prompt)")


def tokens_hash(token_ids: list[int], block_hashes: list[int], block_size: int) -> int:
    """`block_hashes` (of the full blocks) extended over the tokens of the partial last block."""
    last = block_hashes[-1] if block_hashes else ROOT_HASH
    tail = token_ids[len(block_hashes) * block_size:]
    return hash_block(last, tail) if tail else last

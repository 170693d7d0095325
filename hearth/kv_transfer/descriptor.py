"""The checks on a KV descriptor (`hearth.engine.kv.transfer_api.KVDescriptor`, re-exported here).

It travels as JSON (prefill worker -> router -> decode worker) and is checked on arrival: a
decode hop's descriptor must be consistent in itself (`check_descriptor`, at the HTTP edge), and
a decode worker pulls only from one whose geometry equals its own and whose block hashes equal
the hashes of the prompt it was given (`check_against`), so it can never splice another
prompt's KV into a request.
"""

from __future__ import annotations

import msgspec

from hearth.engine.kv.block_hash import ROOT_HASH, hash_block, hash_blocks
from hearth.engine.kv.transfer_api import DESCRIPTOR_VERSION, KVCacheGeometry, KVDescriptor
from hearth.engine.kv.cache import cdiv
from hearth.engine.refusals import RequestRejected

MAX_TRANSFER_ID_BYTES = 64  # it fills a fixed field of the wire header


def geometry_key(geometry: KVCacheGeometry) -> tuple:
    return (geometry.block_size, geometry.num_layers, geometry.num_planes, geometry.num_kv_heads,
            geometry.head_dim, geometry.dtype, geometry.bytes_per_block)


def descriptor_to_json(descriptor: KVDescriptor) -> dict:
    return msgspec.to_builtins(descriptor)


def descriptor_from_json(obj: object) -> KVDescriptor:
    """Parse and check internal consistency; RequestRejected (a ValueError) names what is wrong."""
    try:
        d = msgspec.convert(obj, KVDescriptor)
    except msgspec.ValidationError as exc:
        raise RequestRejected("kv_transfer.descriptor", f"kv_transfer.descriptor: {exc}") from None
    check_descriptor(d)
    return d


def check_descriptor(d: KVDescriptor) -> None:
    """Internal consistency of a parsed descriptor; RequestRejected (a ValueError) names what is wrong."""
    if d.version != DESCRIPTOR_VERSION:
        raise RequestRejected(
            "kv_transfer.descriptor.version",
            f"kv_transfer.descriptor.version: {d.version} is not supported "
            f"(this worker speaks {DESCRIPTOR_VERSION})")
    check_transfer_id(d.transfer_id)
    if d.num_tokens < 1 or d.block_size < 1:
        raise RequestRejected(
            "kv_transfer.descriptor",
            "kv_transfer.descriptor: num_tokens and block_size must be >= 1")
    if len(d.block_ids) != cdiv(d.num_tokens, d.block_size):
        raise RequestRejected(
            "kv_transfer.descriptor.block_ids",
            f"kv_transfer.descriptor.block_ids: {len(d.block_ids)} blocks cannot "
            f"hold {d.num_tokens} tokens of {d.block_size}")
    if len(d.block_hashes) != d.num_tokens // d.block_size:
        raise RequestRejected(
            "kv_transfer.descriptor.block_hashes",
            "kv_transfer.descriptor.block_hashes: one hash per full block expected")
    if not 0 < d.port < 65536:
        raise RequestRejected(
            "kv_transfer.descriptor.port",
            f"kv_transfer.descriptor.port: {d.port} is not a port")


def check_transfer_id(transfer_id: object) -> None:
    if not isinstance(transfer_id, str) or not transfer_id:
        raise RequestRejected(
            "kv_transfer.transfer_id",
            "kv_transfer.transfer_id: must be a non-empty string")
    if len(transfer_id.encode()) > MAX_TRANSFER_ID_BYTES or "\0" in transfer_id:
        raise RequestRejected(
            "kv_transfer.transfer_id",
            f"kv_transfer.transfer_id: at most {MAX_TRANSFER_ID_BYTES} bytes of "
            f"UTF-8 without NUL")


def check_against(d: KVDescriptor, geometry: KVCacheGeometry, prompt_token_ids: list[int]) -> None:
    """The descriptor must describe this prompt's KV in this worker's layout."""
    if d.dtype != geometry.dtype:
        raise RequestRejected(
            "kv_transfer.descriptor.dtype",
            f"kv_transfer.descriptor: KV layout differs from this worker's: the prefill "
            f"worker's KV cache is {d.dtype}, this worker's {geometry.dtype} (start both "
            f"with the same --kv-cache-dtype)")
    if d.geometry_key() != geometry_key(geometry):
        raise RequestRejected(
            "kv_transfer.descriptor",
            f"kv_transfer.descriptor: KV layout {d.geometry_key()} differs from this "
            f"worker's {geometry_key(geometry)} (same model, dtype and block size "
            f"are required)")
    if d.num_tokens != len(prompt_token_ids):
        raise RequestRejected(
            "kv_transfer.descriptor.num_tokens",
            f"kv_transfer.descriptor.num_tokens: {d.num_tokens}, but the prompt has "
            f"{len(prompt_token_ids)} tokens")
    hashes = hash_blocks(prompt_token_ids, d.block_size)
    full = tokens_hash(prompt_token_ids, hashes, d.block_size)
    if hashes != d.block_hashes or full != d.tokens_hash:
        raise RequestRejected(
            "kv_transfer.descriptor",
            "kv_transfer.descriptor: its hashes do not match the prompt's tokens "
            "(the KV belongs to another prompt)")


def tokens_hash(token_ids: list[int], block_hashes: list[int], block_size: int) -> int:
    """`block_hashes` (of the full blocks) extended over the tokens of the partial last block."""
    last = block_hashes[-1] if block_hashes else ROOT_HASH
    tail = token_ids[len(block_hashes) * block_size:]
    return hash_block(last, tail) if tail else last

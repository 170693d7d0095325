"""The stored form of one KV block: a fixed, versioned header and the block's raw bytes.

    offset  size  field
    0       4     magic b"HKVB"
    4       2     version (1)
    6       2     header bytes (68)
    8       16    namespace (model + KV layout, hex text; kv_tiers.store_namespace)
    24      8     block hash (the chained prefix-cache hash the record is stored under)
    32      16    num_layers, block_size, num_kv_heads, head_dim (u32 each)
    48      8     dtype name, NUL-padded ("float32", "bfloat16", ...)
    56      8     payload bytes
    64      4     crc32 of the payload
    68      ...   payload: the block as `[num_layers, planes, block_size, num_kv_heads, head_dim]`

A record is accepted only if every field matches what the reader expects (its hash, namespace,
layout) and the payload's length and checksum match: a torn write, a file of another model or
layout, or flipped bytes are all rejected before a byte reaches the pool. Little-endian; no pickle.
"""

from __future__ import annotations

import struct
import zlib

from hearth.engine.kv.transfer_api import KVCacheGeometry

MAGIC = b"HKVB"
VERSION = 1
HEADER = struct.Struct("<4sHH16sQIIII8sQI")


class BlockRecordError(ValueError):
    """A stored block failed its checks (never loaded; the caller drops the record)."""


def record_bytes(geometry: KVCacheGeometry) -> int:
    return HEADER.size + geometry.bytes_per_block


def encode_header(namespace: str, block_hash: int, geometry: KVCacheGeometry,
                  payload: memoryview) -> bytes:
    g = geometry
    return HEADER.pack(MAGIC, VERSION, HEADER.size, namespace.encode()[:16], block_hash,
                       g.num_layers, g.block_size, g.num_kv_heads, g.head_dim,
                       g.dtype.encode()[:8], len(payload), zlib.crc32(payload))


def check_record(record: memoryview, namespace: str, block_hash: int,
                 geometry: KVCacheGeometry) -> memoryview:
    """The payload of a record that passes every check, else BlockRecordError."""
    g = geometry
    if len(record) < HEADER.size:
        raise BlockRecordError(f"record of {len(record)} bytes is shorter than its header")
    (magic, version, header_bytes, ns, stored_hash, num_layers, block_size, num_kv_heads,
     head_dim, dtype, payload_bytes, crc) = HEADER.unpack_from(record)
    if magic != MAGIC or version != VERSION or header_bytes != HEADER.size:
        raise BlockRecordError(f"not a version-{VERSION} block record")
    if ns != namespace.encode()[:16].ljust(16, b"\0") or stored_hash != block_hash:
        raise BlockRecordError("record of another block or model")
    if ((num_layers, block_size, num_kv_heads, head_dim) !=
            (g.num_layers, g.block_size, g.num_kv_heads, g.head_dim)
            or dtype.rstrip(b"\0").decode(errors="replace") != g.dtype):
        raise BlockRecordError("record of another KV layout")
    payload = record[HEADER.size:]
    if payload_bytes != g.bytes_per_block or len(payload) != payload_bytes:
        raise BlockRecordError(f"payload of {len(payload)} bytes, expected {g.bytes_per_block}")
    if zlib.crc32(payload) != crc:
        raise BlockRecordError("checksum mismatch")
    return payload

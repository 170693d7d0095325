"""The KV-connector interface: what the engine needs from prefill/decode disaggregation.

The engine never imports `hearth.kv_transfer`; the server hands it a factory that builds an object
with this interface (`hearth.kv_transfer.connector.DisaggConnector`). All calls come from the engine's
own thread; the connector's transfer threads talk back only through `poll`, so the block pool
(which is not thread-safe) is touched by the engine alone.

Export (prefill role): a request added with `KVTransfer(role="prefill")` runs its prompt and
samples one token as usual; at its finish the engine hands its block references to
`connector.export`, which keeps them under a lease and returns the `KVDescriptor` the output
carries. The connector later returns those block ids from `poll` (ack, reject or expiry) and the
engine frees them.

Import (decode role): a request added with `KVTransfer(role="decode")` holds prompt + first
token. The scheduler adopts its local prefix-cache hits, allocates blocks for the rest of the
prompt and parks it in `importing`; the engine calls `connector.start_import` with the missing
block positions, and resumes the request when `poll` reports the import done (or, on failure,
lets it compute the missing prompt tokens itself).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol

import msgspec

from hearth.config import Role

if TYPE_CHECKING:  # kept torch-free at import: the router imports the hop types built on this
    import torch

# int8 / fp8_e4m3: a row is head_dim - 4 8-bit values then their float32 scale
# (hearth/ops/kv_quant.py), so head_dim below is the row's width in bytes and the scales travel
# inside the blocks.
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1, "fp8_e4m3": 1}
# torch dtype names that KV descriptors and tier records spell otherwise (a tier record's header
# has 8 bytes for the name: "float8_e4m3fn" would not fit)
_DTYPE_NAMES = {"float8_e4m3fn": "fp8_e4m3"}
DESCRIPTOR_VERSION = 1


class KVDescriptor(msgspec.Struct, frozen=True, kw_only=True):
    """What a prefill worker tells a decode worker about the KV it holds under a lease.

    One type from end to end: `connector.export` makes it, `RequestOutput` carries it to the
    server, the prefill hop's response and the decode hop's request carry it as JSON (the
    router passes it on typed), `KVTransfer` hands it to the decode engine. Its checks live in
    hearth/kv_transfer/descriptor.py."""

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
    num_layers: int  # KV geometry: [num_layers, planes, *, block_size, num_kv_heads, head_dim]
    num_kv_heads: int
    head_dim: int
    # "float32" | "bfloat16" | "float16" | "int8" | "fp8_e4m3" (the last two: head_dim counts
    # the scale)
    dtype: str
    bytes_per_block: int  # planes * num_layers * block_size * num_kv_heads * head_dim * itemsize
    expires_at: float  # unix time at which the lease ends (prefill clock; a hint for the reader)
    mooncake_session: str = ""  # mooncake: "host:port" of the prefill's transfer engine
    mooncake_base_address: int = 0  # mooncake: address of the prefill KV tensor
    mooncake_num_blocks: int = 0  # mooncake: blocks in the prefill KV tensor (plane stride)
    # 2: K and V planes of num_kv_heads heads; 1: MLA's latent rows (ModelArch.kv_cache_layout)
    num_planes: int = 2

    def geometry_key(self) -> tuple:
        return (self.block_size, self.num_layers, self.num_planes, self.num_kv_heads,
                self.head_dim, self.dtype, self.bytes_per_block)


@dataclass(frozen=True)
class KVTransfer:
    """The per-request disaggregation spec given to `LLMEngine.add_request`."""

    role: Role  # PREFILL: export the prompt's KV; DECODE: import it (never BOTH)
    transfer_id: str = ""  # prefill: the lease key chosen by the router
    descriptor: KVDescriptor | None = None  # decode: the prefill worker's descriptor
    first_token_id: int | None = None  # decode: the token the prefill worker sampled

    def __post_init__(self) -> None:
        role = Role.parse(self.role, "kv_transfer.role")
        if role is Role.BOTH:
            raise ValueError("kv_transfer.role: a hop is either prefill or decode")
        object.__setattr__(self, "role", role)


@dataclass(frozen=True)
class KVCacheGeometry:
    """The local KV tensor's shape, `[num_layers, num_planes, num_blocks, block_size,
    num_kv_heads, head_dim]` (planes: K and V, or MLA's one latent plane of one "head"); two
    workers can exchange blocks only if all but num_blocks agree."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # "float32", "bfloat16", "int8", ...: torch's name (fp8 e4m3: "fp8_e4m3")
    num_planes: int = 2

    @classmethod
    def of(cls, kv_cache, block_size: int) -> "KVCacheGeometry":
        """The geometry of a KV tensor `[layers, planes, blocks, block_size, heads, dim]`."""
        num_layers, planes, num_blocks, _, heads, dim = kv_cache.shape
        name = str(kv_cache.dtype).removeprefix("torch.")
        return cls(num_layers, num_blocks, block_size, heads, dim, _DTYPE_NAMES.get(name, name),
                   planes)

    @property
    def bytes_per_chunk(self) -> int:
        """Bytes of one block in one (layer, plane): the unit that is contiguous in memory."""
        return self.block_size * self.num_kv_heads * self.head_dim * ITEMSIZE[self.dtype]

    @property
    def bytes_per_block(self) -> int:
        return self.num_planes * self.num_layers * self.bytes_per_chunk


@dataclass
class ImportResult:
    """One finished import, reported by `poll`. On failure the blocks are zeroed and nothing
    more is written to them."""

    request_id: str
    ok: bool
    num_blocks: int = 0  # blocks received over the wire
    num_bytes: int = 0
    error: str | None = None


@dataclass
class ConnectorEvents:
    released_block_ids: list[list[int]] = field(default_factory=list)  # leases ended: free these
    imports: list[ImportResult] = field(default_factory=list)


class KVConnector(Protocol):
    def check_export(self, transfer_id: str) -> None:
        """Raise ValueError if a prefill request with this transfer id cannot be exported."""

    def check_import(self, transfer: KVTransfer, prompt_token_ids: list[int]) -> object:
        """Validate a decode spec against the prompt and the local geometry (ValueError if not);
        return the parsed handle that `start_import` receives."""

    def export(self, transfer_id: str, block_ids: list[int], block_hashes: list[int],
               prompt_token_ids: list[int]) -> KVDescriptor:
        """Take ownership of one reference on each block under a lease; return the descriptor."""

    def start_import(self, request_id: str, handle: object, positions: list[int],
                     block_ids: list[int]) -> None:
        """Fill local `block_ids[i]` with the remote block at descriptor position `positions[i]`
        in the background (an empty list only acknowledges), then report it from `poll`."""

    def reject(self, handle: object) -> None:
        """In the background, tell the exporter that an imported spec will not be read (the
        decode request was aborted before its transfer started)."""

    def poll(self) -> ConnectorEvents:
        """Sweep expired leases and collect what the transfer threads finished (never blocks)."""

    def wait(self, timeout: float) -> None:
        """Block up to `timeout` seconds until an import may have finished."""

    def num_leases(self) -> int: ...

    def close(self) -> None:
        """Stop the transfer threads and end every lease (the next `poll` returns their blocks)."""


# Built by the engine once its KV tensor exists: factory(kv_transfer_config, kv_cache, geometry).
ConnectorFactory = Callable[[object, "torch.Tensor", KVCacheGeometry], KVConnector]

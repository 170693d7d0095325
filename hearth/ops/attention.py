"""Attention over the paged KV cache.

The cache of one layer is a pair of tensors `[num_blocks, block_size, num_kv_heads, head_dim]`.
Token t of a request lives at slot `block_table[t // block_size] * block_size + t % block_size`.

A step's tokens are packed without padding (`[num_tokens, ...]`); `AttentionMetadata` says
which rows belong to which request:

    tokens:   | req0 chunk (8) | req1 (1) | req2 (1) | req3 chunk (5) |
    query:    q_start=0 len=8   8 len=1    9 len=1    10 len=5
    context:  ctx_len = tokens computed before this step + query len

The math over it lives in hearth/ops/attention_backends/ (hearth's CPU kernels, torch's SDPA on
the CPU or CUDA); this module holds what every backend reads: the step's metadata and the
plain-torch cache write.

The cache may be narrower than the model: bfloat16, or int8 / fp8 (e4m3) rows with a float32
scale each (`kv_quant.py`: the cache's last dimension is then head_dim + 4). The kernels read
them in place; the torch backends widen what they gather.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from hearth.ops import kv_quant

# Requests with at most this many new tokens in a step go through the kernel's short-query path.
SHORT_QUERY_MAX = 16


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot each new token's K/V is written to
    # Prefill-like requests (query_len > 1), one entry each:
    prefill_query_starts: list[int]
    prefill_query_lens: list[int]
    prefill_context_lens: list[int]
    prefill_block_tables: list[torch.Tensor]  # each [num_blocks_of_request] int64
    # Decode requests (query_len == 1), batched:
    decode_token_index: torch.Tensor  # [num_decodes] int64: row of each decode in the packed tokens
    num_tokens: int = 0
    # Short-query requests (1 <= query_len <= SHORT_QUERY_MAX), the CPU kernel's input:
    short_token_index: torch.Tensor | None = None  # [num_short_tokens] int64 rows, request order
    short_query_lens: torch.Tensor | None = None  # [num_short] int32
    short_context_lens: torch.Tensor | None = None  # [num_short] int32
    short_block_table_i32: torch.Tensor | None = None  # [num_short, max_blocks] int32, 0-padded
    num_short_tokens: int = 0
    short_max: int = SHORT_QUERY_MAX  # the limit these were built with (the kernel path reads it)
    # The decodes' block tables and context lengths as lists: `decode_block_table` and
    # `decode_mask` (only the torch backends read them) are built from these on first use, not
    # on every step the kernels run.
    decode_tables: list[list[int]] = field(default_factory=list)
    decode_context_lens: list[int] = field(default_factory=list)
    block_size: int = 0
    device: torch.device | str = "cpu"

    @property
    def num_decodes(self) -> int:
        return int(self.decode_token_index.numel())

    @functools.cached_property
    def decode_block_table(self) -> torch.Tensor:
        """[num_decodes, max_blocks] int64, padded with 0."""
        return padded_table(self.decode_tables, torch.long).to(self.device)

    @functools.cached_property
    def decode_mask(self) -> torch.Tensor:
        """[num_decodes, 1, 1, max_blocks * block_size] bool: True = attend."""
        width = self.decode_block_table.shape[1] * self.block_size
        ctx = torch.tensor(self.decode_context_lens, dtype=torch.long)
        mask = torch.arange(width)[None, :] < ctx[:, None]
        return mask[:, None, None, :].to(self.device)


@dataclass(frozen=True)
class AttentionSpec:
    """How one layer's queries see keys, beyond plain causal attention. Query i of a request
    (its position in the context) sees key j <= i, and further:

        window W:  only the last W keys, j > i - W                (Mistral, gpt-oss)
        chunk C:   only keys of its own chunk, j // C == i // C   (Llama 4's local layers)
        sinks:     [H] float32, one learned logit per query head that joins every softmax
                   as a key with no value (gpt-oss): out = sum_j p_j v_j with
                   p_j = e^(s_j) / (sum_k e^(s_k) + e^(sink_h)), so the weights may sum to < 1

    Both limits may be set (a token then sees the keys both allow). The default is plain causal
    attention, which every backend's fast paths serve.
    """

    window: int | None = None
    chunk: int | None = None
    sinks: torch.Tensor | None = None

    def __post_init__(self) -> None:
        for name in ("window", "chunk"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"attention {name} must be at least 1, got {value}")

    @property
    def is_causal(self) -> bool:
        """Plain causal attention: nothing to limit, no sinks."""
        return self.window is None and self.chunk is None and self.sinks is None

    def first_key(self, positions: torch.Tensor) -> torch.Tensor:
        """The first key each query position sees (int64, like `positions`)."""
        first = torch.zeros_like(positions)
        if self.window is not None:
            first = torch.maximum(first, positions - self.window + 1)
        if self.chunk is not None:
            first = torch.maximum(first, positions // self.chunk * self.chunk)
        return first


CAUSAL = AttentionSpec()


def padded_table(tables: list[list[int]], dtype: torch.dtype) -> torch.Tensor:
    """[len(tables), longest] block tables, each padded with 0, in one torch.tensor call."""
    width = max((len(t) for t in tables), default=0)
    return torch.tensor([[*t, *([0] * (width - len(t)))] for t in tables],
                        dtype=dtype).reshape(len(tables), width)


def build_attention_metadata(
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
    short_max: int | None = None,
) -> AttentionMetadata:
    """Metadata for one step; request i computes its tokens [ctx - q, ctx). Requests with at most
    `short_max` (default SHORT_QUERY_MAX) new tokens take the kernel's short-query path."""
    short_max = SHORT_QUERY_MAX if short_max is None else short_max
    slots: list[int] = []
    p_starts, p_lens, p_ctx, p_tables = [], [], [], []
    d_index, d_tables, d_ctx = [], [], []
    s_index, s_lens, s_ctx, s_tables = [], [], [], []
    start = 0
    for q_len, ctx_len, table in zip(query_lens, context_lens, block_tables):
        for pos in range(ctx_len - q_len, ctx_len):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
        num_blocks = -(-ctx_len // block_size)
        if q_len <= short_max:
            s_index.extend(range(start, start + q_len))
            s_lens.append(q_len)
            s_ctx.append(ctx_len)
            s_tables.append(table[:num_blocks])
        if q_len == 1:
            d_index.append(start)
            d_tables.append(table[:num_blocks])
            d_ctx.append(ctx_len)
        else:
            p_starts.append(start)
            p_lens.append(q_len)
            p_ctx.append(ctx_len)
            p_tables.append(torch.tensor(table[:num_blocks], dtype=torch.long, device=device))
        start += q_len
    s_table = padded_table(s_tables, torch.int32)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        prefill_query_starts=p_starts,
        prefill_query_lens=p_lens,
        prefill_context_lens=p_ctx,
        prefill_block_tables=p_tables,
        decode_token_index=torch.tensor(d_index, dtype=torch.long, device=device),
        num_tokens=start,
        short_token_index=torch.tensor(s_index, dtype=torch.long, device=device),
        short_query_lens=torch.tensor(s_lens, dtype=torch.int32, device=device),
        short_context_lens=torch.tensor(s_ctx, dtype=torch.int32, device=device),
        short_block_table_i32=s_table.to(device),
        num_short_tokens=len(s_index),
        short_max=short_max,
        decode_tables=d_tables,
        decode_context_lens=d_ctx,
        block_size=block_size,
        device=device,
    )


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter this step's K/V rows ([num_tokens, num_kv_heads, head_dim]) into the cache,
    rounded or quantized to its format."""
    k, v = kv_quant.to_cache(k, k_cache.dtype), kv_quant.to_cache(v, v_cache.dtype)
    num_kv_heads, width = k.shape[1], k.shape[2]
    kv_quant.copy_rows(k_cache.view(-1, num_kv_heads, width), k, slot_mapping)
    kv_quant.copy_rows(v_cache.view(-1, num_kv_heads, width), v, slot_mapping)


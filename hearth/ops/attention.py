"""Attention over the paged KV cache.

The cache of one layer is a pair of tensors `[num_blocks, block_size, num_kv_heads, head_dim]`.
Token t of a request lives at slot `block_table[t // block_size] * block_size + t % block_size`.

A step's tokens are packed without padding (`[num_tokens, ...]`); `AttentionMetadata` says
which rows belong to which request:

    tokens:   | req0 chunk (8) | req1 (1) | req2 (1) | req3 chunk (5) |
    query:    q_start=0 len=8   8 len=1    9 len=1    10 len=5
    context:  ctx_len = tokens computed before this step + query len

Backends: requests with one query token (decodes) are batched into one padded SDPA call over
their gathered blocks with a length mask; longer queries (prefill chunks) run one SDPA call each,
causal; after a cached prefix, on CPU two flash calls (the prefix unmasked, the chunk's own keys
causal) merged by log-sum-exp, elsewhere one call with the offset causal mask written out. All
paths work on CPU and CUDA. With hearth's CPU
kernels, every request with at most SHORT_QUERY_MAX new tokens (decodes, and speculative
decoding's verify steps of 1 + k tokens) attends in one kernel call over the cache in place,
causal among its new tokens; with an AVX-512 build, longer queries (prefill chunks, after a
cached prefix or not) are one kernel call each over the cache in place too (flash-style tiles,
~1.35x torch's CPU flash kernel on a 2k-token prompt), and only the other builds take the
SDPA loop.

The cache may be narrower than the model: bfloat16, or int8 / fp8 (e4m3) rows with a float32
scale each (`kv_quant.py`: the cache's last dimension is then head_dim + 4). The kernels read
them in place; the torch paths widen what they gather.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

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
    decode_block_table: torch.Tensor  # [num_decodes, max_blocks] int64, padded with 0
    decode_mask: torch.Tensor  # [num_decodes, 1, 1, max_blocks * block_size] bool: True = attend
    num_tokens: int = 0
    # Short-query requests (1 <= query_len <= SHORT_QUERY_MAX), the CPU kernel's input:
    short_token_index: torch.Tensor | None = None  # [num_short_tokens] int64 rows, request order
    short_query_lens: torch.Tensor | None = None  # [num_short] int32
    short_context_lens: torch.Tensor | None = None  # [num_short] int32
    short_block_table_i32: torch.Tensor | None = None  # [num_short, max_blocks] int32, 0-padded
    num_short_tokens: int = 0
    short_max: int = SHORT_QUERY_MAX  # the limit these were built with (the kernel path reads it)

    @property
    def num_decodes(self) -> int:
        return int(self.decode_token_index.numel())


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
    max_blocks = max((len(t) for t in d_tables), default=0)
    table = torch.zeros((len(d_tables), max_blocks), dtype=torch.long)
    for i, t in enumerate(d_tables):
        table[i, : len(t)] = torch.tensor(t, dtype=torch.long)
    ctx = torch.tensor(d_ctx, dtype=torch.long)
    mask = torch.arange(max_blocks * block_size)[None, :] < ctx[:, None]
    s_table = torch.zeros((len(s_tables), max((len(t) for t in s_tables), default=0)),
                          dtype=torch.int32)
    for i, t in enumerate(s_tables):
        s_table[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        prefill_query_starts=p_starts,
        prefill_query_lens=p_lens,
        prefill_context_lens=p_ctx,
        prefill_block_tables=p_tables,
        decode_token_index=torch.tensor(d_index, dtype=torch.long, device=device),
        decode_block_table=table.to(device),
        decode_mask=mask[:, None, None, :].to(device),
        num_tokens=start,
        short_token_index=torch.tensor(s_index, dtype=torch.long, device=device),
        short_query_lens=torch.tensor(s_lens, dtype=torch.int32, device=device),
        short_context_lens=torch.tensor(s_ctx, dtype=torch.int32, device=device),
        short_block_table_i32=s_table.to(device),
        num_short_tokens=len(s_index),
        short_max=short_max,
    )


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter this step's K/V rows ([num_tokens, num_kv_heads, head_dim]) into the cache,
    rounded or quantized to its format."""
    k, v = kv_quant.to_cache(k, k_cache.dtype), kv_quant.to_cache(v, v_cache.dtype)
    num_kv_heads, width = k.shape[1], k.shape[2]
    kv_quant.copy_rows(k_cache.view(-1, num_kv_heads, width), k, slot_mapping)
    kv_quant.copy_rows(v_cache.view(-1, num_kv_heads, width), v, slot_mapping)


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim] (this step's keys)
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    kernels=None,  # CpuKernels: short queries attend over the cache in place (no gather)
    kv_written: bool = False,  # the caller already wrote this step's K/V (fused RoPE + write)
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend; returns [num_tokens, num_heads, head_dim].
    The cache may hold a narrower dtype than q (bfloat16, int8 or fp8 KV): it is widened where it is read, and
    a prompt attending to its own fresh keys rounds them the same way first, so a token's
    attention reads the same K/V whether it was computed now or earlier (prefix hit, recompute
    after preemption, PD import). q may be bfloat16 over a float32 cache (a many-row step of
    --prefill-dtype bfloat16): prompt chunks then attend in bf16, through hearth's AMX kernel
    where the avx512amx build runs (head dim 64) and torch's flash kernel elsewhere (~2x
    hearth's fp32 kernel on a 2k prompt), and the kernel's short queries in fp32, their rows
    widened and the output rounded back."""
    if not kv_written:
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    use_kernel = kernels is not None and q.device.type == "cpu"
    if use_kernel and meta.num_short_tokens == meta.num_tokens:
        # Only short queries in this step: the kernel's output is the whole result.
        return short_query_attention(q, k_cache, v_cache, meta, scale, kernels)
    out = torch.empty_like(q)
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    prefill_kernel = (use_kernel and q.dtype == torch.float32
                      and kernels.fast_prefill_attention(q.shape[1], num_kv_heads, head_dim))
    amx_kernel = (use_kernel and q.dtype == torch.bfloat16
                  and not kv_quant.is_scaled(k_cache.dtype)
                  and kernels.amx_prefill_attention(head_dim))
    for start, q_len, ctx_len, table in zip(meta.prefill_query_starts, meta.prefill_query_lens,
                                            meta.prefill_context_lens, meta.prefill_block_tables):
        if use_kernel and q_len <= meta.short_max:
            continue  # the kernel below does it
        if prefill_kernel or amx_kernel:  # the chunk over the cache in place, its K/V included
            op = kernels.ops.amx_prefill_attention if amx_kernel else kernels.ops.prefill_attention
            out[start : start + q_len] = op(q[start : start + q_len], k_cache, v_cache, table,
                                            ctx_len, scale, kernels.threads.count)
            continue
        qi = q[start : start + q_len].transpose(0, 1)  # [H, q, D]
        if ctx_len == q_len:  # nothing cached before: attend to this step's own keys
            ki, vi = k[start : start + q_len], v[start : start + q_len]
            # as the cache rounds them
            ki, vi = kv_quant.as_cached(ki, k_cache.dtype), kv_quant.as_cached(vi, v_cache.dtype)
            mask, causal = None, True
        else:
            ki = kv_quant.widen(k_cache[table], q.dtype).view(-1, num_kv_heads, head_dim)[:ctx_len]
            vi = kv_quant.widen(v_cache[table], q.dtype).view(-1, num_kv_heads, head_dim)[:ctx_len]
            if q.device.type == "cpu":
                o = _prefix_chunk_attention(qi, ki.transpose(0, 1), vi.transpose(0, 1),
                                            ctx_len - q_len, scale)
                out[start : start + q_len] = o.transpose(0, 1)
                continue
            offset = ctx_len - q_len
            rows = torch.arange(q_len, device=q.device)[:, None] + offset
            mask = torch.arange(ctx_len, device=q.device)[None, :] <= rows
            causal = False
        # 4-D inputs: torch's CPU flash kernel only takes a batch dimension; 3-D inputs fall
        # back to the math path, ~6x slower on a 2k-token prompt.
        o = F.scaled_dot_product_attention(
            qi[None], ki.transpose(0, 1)[None], vi.transpose(0, 1)[None], attn_mask=mask,
            is_causal=causal, scale=scale, enable_gqa=True,
        )
        out[start : start + q_len] = o[0].transpose(0, 1)
    if use_kernel:
        if meta.num_short_tokens:
            out[meta.short_token_index] = short_query_attention(q[meta.short_token_index], k_cache,
                                                                v_cache, meta, scale, kernels)
    elif meta.num_decodes:
        num_decodes = meta.num_decodes
        qd = q[meta.decode_token_index].unsqueeze(2)  # [B, H, 1, D]
        kd = kv_quant.widen(k_cache[meta.decode_block_table], q.dtype).view(
            num_decodes, -1, num_kv_heads, head_dim)
        vd = kv_quant.widen(v_cache[meta.decode_block_table], q.dtype).view(
            num_decodes, -1, num_kv_heads, head_dim)
        o = F.scaled_dot_product_attention(
            qd, kd.transpose(1, 2), vd.transpose(1, 2), attn_mask=meta.decode_mask,
            scale=scale, enable_gqa=True,
        )
        out[meta.decode_token_index] = o.squeeze(2)
    return out


def _prefix_chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int,
                            scale: float) -> torch.Tensor:
    """A chunk's queries ([H, q, D]) after `prefix` cached tokens, over keys/values [KV, ctx, D]:
    causal with the diagonal offset by `prefix`. Two calls of torch's CPU flash kernel, each
    unmasked or plainly causal, merged by their log-sum-exps: the cached prefix (every query sees
    all of it) and the chunk's own keys (causal). A materialized offset mask instead makes SDPA
    compute and mask the whole [q, ctx] score matrix at ~half the kernel's rate; a 2k-token
    prompt after a 32-token prefix hit (a shared system prompt) took 1.6x as long."""
    num_heads, q_len, head_dim = q.shape
    num_kv_heads = k.shape[0]
    group = num_heads // num_kv_heads
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    # The prefix part has no mask, so a KV head's `group` query heads stack along the sequence
    # (GQA without repeating K/V).
    qg = q.reshape(num_kv_heads, group * q_len, head_dim)[None]
    o1, lse1 = flash(qg, k[None, :, :prefix], v[None, :, :prefix], scale=scale)
    o1, lse1 = o1.reshape(num_heads, q_len, head_dim), lse1.reshape(num_heads, q_len)
    k2, v2 = k[:, prefix:], v[:, prefix:]
    if group > 1:
        k2, v2 = k2.repeat_interleave(group, 0), v2.repeat_interleave(group, 0)
    o2, lse2 = flash(q[None], k2[None], v2[None], is_causal=True, scale=scale)
    o2, lse2 = o2[0], lse2[0]
    o1, o2, lse1, lse2 = o1.float(), o2.float(), lse1.float(), lse2.float()  # bf16 inputs
    lse = torch.logaddexp(lse1, lse2)
    return o1 * (lse1 - lse).exp_()[..., None] + o2 * (lse2 - lse).exp_()[..., None]


def short_query_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, kernels):
    """The CPU kernel over the step's short-query requests (`q`: their rows, request order); it
    computes in fp32, so bf16 rows are widened and the output rounded back."""
    out = kernels.ops.decode_attention(q.float(), k_cache, v_cache, meta.short_block_table_i32,
                                       meta.short_context_lens, scale, kernels.decode_split,
                                       kernels.threads.count, meta.short_query_lens)
    return out.to(q.dtype)

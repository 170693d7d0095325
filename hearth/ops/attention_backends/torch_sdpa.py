"""Attention in plain torch on the CPU: the fallback where no kernel build is loaded.

Dense heads: decodes (one new token) are batched into one padded SDPA call over their gathered
blocks with a length mask; every longer query (a prompt chunk) is one causal SDPA call. After a
cached prefix a chunk takes two calls of torch's CPU flash kernel (the prefix unmasked, the
chunk's own keys causal) merged by log-sum-exp (`prefix_chunk_attention`): torch's CPU flash
kernel takes no offset causal mask, and a written-out one runs at half its rate. The cache may
be narrower than q (bfloat16, int8 / fp8 rows with a scale): what is gathered is widened.

A layer with a sliding window, chunked-local attention or sinks (`AttentionSpec`) takes
`limited`: each request over only the blocks its queries can see, float32 scores with the
window / chunk mask and the sink logit as one more softmax column (`limited_attention`).

MLA: short queries attend over their gathered latent rows in float32, one request at a time;
prompt chunks as above over the K/V the model up-projected.

`CudaAttentionBackend` (cuda.py) is this one with the prefix chunk in one masked SDPA call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hearth.ops import kv_quant
from hearth.ops.attention import CAUSAL, AttentionMetadata, AttentionSpec, write_kv


class TorchAttentionBackend:
    name = "torch"
    kernels = None

    def rope_write_kv(self, *args, **kwargs) -> bool:
        return False  # no fused pass: the model rotates in torch, then `write_kv`

    def write_kv(self, k, v, k_cache, v_cache, meta: AttentionMetadata) -> None:
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)

    def attend(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
               spec: AttentionSpec = CAUSAL) -> torch.Tensor:
        if not spec.is_causal:
            return self.limited(q, k_cache, v_cache, meta, scale, spec)
        out = torch.empty_like(q)
        for start, q_len, ctx_len, table in zip(meta.prefill_query_starts, meta.prefill_query_lens,
                                                meta.prefill_context_lens, meta.prefill_block_tables):
            rows = slice(start, start + q_len)
            out[rows] = self.prompt_chunk(q[rows], k[rows], v[rows], k_cache, v_cache, table,
                                          ctx_len, scale)
        if meta.num_decodes:
            out[meta.decode_token_index] = self.decodes(q, k_cache, v_cache, meta, scale)
        return out

    def prompt_chunk(self, q, k, v, k_cache, v_cache, table: torch.Tensor, ctx_len: int,
                     scale: float) -> torch.Tensor:
        """One request's chunk (q, k, v: [q, H or KVH, D]) over its context, the chunk's own
        K/V last; [q, H, D]."""
        q_len, num_kv_heads, head_dim = q.shape[0], k.shape[1], k.shape[2]
        qi = q.transpose(0, 1)  # [H, q, D]
        if ctx_len > q_len:  # after a cached prefix: the whole context from the cache
            ki = kv_quant.widen(k_cache[table], q.dtype).view(-1, num_kv_heads, head_dim)[:ctx_len]
            vi = kv_quant.widen(v_cache[table], q.dtype).view(-1, num_kv_heads, head_dim)[:ctx_len]
            o = self.prefix_chunk(qi, ki.transpose(0, 1), vi.transpose(0, 1), ctx_len - q_len,
                                  scale, enable_gqa=True)
            return o.transpose(0, 1)
        # Nothing cached before: the chunk's own keys, as the cache rounds them. 4-D inputs:
        # torch's CPU flash kernel only takes a batch dimension; 3-D inputs fall back to the
        # math path, ~6x slower on a 2k-token prompt.
        ki, vi = kv_quant.as_cached(k, k_cache.dtype), kv_quant.as_cached(v, v_cache.dtype)
        o = F.scaled_dot_product_attention(
            qi[None], ki.transpose(0, 1)[None], vi.transpose(0, 1)[None], attn_mask=None,
            is_causal=True, scale=scale, enable_gqa=True,
        )
        return o[0].transpose(0, 1)

    def prefix_chunk(self, q, k, v, prefix: int, scale: float, enable_gqa: bool) -> torch.Tensor:
        """A chunk's queries [H, q, D] after `prefix` cached tokens over keys/values
        [KVH, ctx, D]: causal with the diagonal offset by `prefix`. [H, q, D], float32 here."""
        return prefix_chunk_attention(q, k, v, prefix, scale)

    def decodes(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Every one-token query of the step in one padded SDPA call; [num_decodes, H, D]."""
        num_decodes, num_kv_heads, head_dim = meta.num_decodes, k_cache.shape[2], q.shape[2]
        qd = q[meta.decode_token_index].unsqueeze(2)  # [B, H, 1, D]
        kd = kv_quant.widen(k_cache[meta.decode_block_table], q.dtype).view(
            num_decodes, -1, num_kv_heads, head_dim)
        vd = kv_quant.widen(v_cache[meta.decode_block_table], q.dtype).view(
            num_decodes, -1, num_kv_heads, head_dim)
        o = F.scaled_dot_product_attention(
            qd, kd.transpose(1, 2), vd.transpose(1, 2), attn_mask=meta.decode_mask,
            scale=scale, enable_gqa=True,
        )
        return o.squeeze(2)

    def limited(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                spec: AttentionSpec) -> torch.Tensor:
        """Every request of the step (prompt chunks and decodes) under `spec`'s window, chunk
        and sinks, one request at a time over the blocks its queries can see."""
        out = torch.empty_like(q)
        requests = [(start, q_len, ctx_len, table.tolist()) for start, q_len, ctx_len, table in
                    zip(meta.prefill_query_starts, meta.prefill_query_lens,
                        meta.prefill_context_lens, meta.prefill_block_tables)]
        requests += [(row, 1, ctx_len, table) for row, ctx_len, table in
                     zip(meta.decode_token_index.tolist(), meta.decode_context_lens,
                         meta.decode_tables)]
        block_size = k_cache.shape[1]
        for start, q_len, ctx_len, table in requests:
            # the blocks from the one holding the first key any of these queries sees
            first = int(spec.first_key(torch.tensor(ctx_len - q_len)))
            first_block = first // block_size
            blocks = torch.tensor(table[first_block:-(-ctx_len // block_size)], dtype=torch.long,
                                  device=q.device)
            offset = first_block * block_size
            keys = kv_quant.widen(k_cache[blocks], torch.float32)
            values = kv_quant.widen(v_cache[blocks], torch.float32)
            num_kv_heads = k_cache.shape[2]
            keys = keys.reshape(-1, num_kv_heads, keys.shape[-1])[:ctx_len - offset]
            values = values.reshape(-1, num_kv_heads, values.shape[-1])[:ctx_len - offset]
            rows = slice(start, start + q_len)
            out[rows] = limited_attention(q[rows], keys, values, ctx_len - q_len, offset, scale,
                                          spec).to(q.dtype)
        return out

    # ---- MLA -----------------------------------------------------------------------------

    def write_latent(self, c, k_pe, cache, meta: AttentionMetadata) -> None:
        row = torch.cat([c.to(cache.dtype), k_pe.to(cache.dtype)], dim=-1)
        cache.view(-1, cache.shape[-1]).index_copy_(0, meta.slot_mapping, row)

    def mla_decode(self, q_lat, cache, meta: AttentionMetadata, scale: float,
                   rank: int) -> torch.Tensor:
        outs, start = [], 0
        tables = meta.short_block_table_i32.long()
        latent_dim = cache.shape[-1]
        for i, (q_len, ctx_len) in enumerate(zip(meta.short_query_lens.tolist(),
                                                 meta.short_context_lens.tolist())):
            rows = cache[tables[i]].view(-1, latent_dim)[:ctx_len].float()  # [ctx, L + R]
            qi = q_lat[start:start + q_len].float()  # [q, H, L + R]
            scores = torch.einsum("qhd,kd->hqk", qi, rows) * scale
            seen = torch.arange(ctx_len, device=qi.device)[None, :] <= (
                torch.arange(q_len, device=qi.device)[:, None] + ctx_len - q_len)
            probs = torch.softmax(scores.masked_fill(~seen, float("-inf")), dim=-1)
            outs.append(torch.einsum("hqk,kl->qhl", probs, rows[:, :rank]))
            start += q_len
        return torch.cat(outs)

    def mla_prefill(self, q, k, v, scale: float) -> torch.Tensor:
        q_len, ctx_len = q.shape[1], k.shape[1]
        if ctx_len == q_len:
            return F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True,
                                                  scale=scale)[0]
        return self.prefix_chunk(q, k, v, ctx_len - q_len, scale, enable_gqa=False).to(q.dtype)


def prefix_chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int,
                           scale: float) -> torch.Tensor:
    """A chunk's queries ([H, q, D]) after `prefix` cached tokens, over keys/values [KV, ctx, D]:
    causal with the diagonal offset by `prefix`. Two calls of torch's CPU flash kernel, each
    unmasked or plainly causal, merged by their log-sum-exps: the cached prefix (every query sees
    all of it) and the chunk's own keys (causal). A materialized offset mask instead makes SDPA
    compute and mask the whole [q, ctx] score matrix at ~half the kernel's rate; a 2k-token
    prompt after a 32-token prefix hit (a shared system prompt) took 1.6x as long. Returns
    float32."""
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


def limited_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      first_position: int, key_offset: int, scale: float,
                      spec: AttentionSpec) -> torch.Tensor:
    """One request's queries q [q, H, D] at positions first_position.. over keys/values
    [n, KVH, D] at positions key_offset.. (the last at first_position + q - 1), causal under
    `spec`. Float32 math, query rows in blocks so the scores stay ~64 MB. Returns [q, H, D]
    float32.

        keys:     key_offset ............................ first_position + q - 1
        query i:      [first_key(i) ........ i]   (window W: i - W + 1; chunk C: i // C * C)
    """
    q_len, num_heads, _ = q.shape
    group = num_heads // keys.shape[1]
    k = keys.transpose(0, 1).repeat_interleave(group, 0)  # [H, n, D]
    v = values.transpose(0, 1).repeat_interleave(group, 0)
    key_pos = torch.arange(key_offset, key_offset + keys.shape[0], device=q.device)
    rows_per_block = max(16, min(256, (1 << 24) // (num_heads * max(1, keys.shape[0]))))
    out = torch.empty(q_len, num_heads, v.shape[-1], dtype=torch.float32, device=q.device)
    for a in range(0, q_len, rows_per_block):
        b = min(q_len, a + rows_per_block)
        pos = torch.arange(first_position + a, first_position + b, device=q.device)
        lo = int(spec.first_key(pos[:1])) - key_offset  # keys before it no row here sees
        hi = first_position + b - key_offset
        scores = torch.einsum("qhd,hkd->hqk", q[a:b].float(), k[:, lo:hi]) * scale
        kp = key_pos[lo:hi]
        seen = (kp[None, :] <= pos[:, None]) & (kp[None, :] >= spec.first_key(pos)[:, None])
        scores.masked_fill_(~seen, float("-inf"))
        if spec.sinks is not None:  # one more key per head, with no value
            sink = spec.sinks.float().view(num_heads, 1, 1).expand(num_heads, b - a, 1)
            probs = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
        else:
            probs = torch.softmax(scores, -1)
        out[a:b] = torch.einsum("hqk,hkd->qhd", probs, v[:, lo:hi])
    return out

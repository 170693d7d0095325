"""Attention through hearth's compiled CPU kernels (`CpuKernels`, hearth/ops/cpu_kernels.py):
the cache is read in place, never gathered.

  * RoPE and the cache write are one pass (`rope_write_kv`, with Qwen3's q/k norms
    `qk_norm_rope_write_kv`).
  * Every request with at most `meta.short_max` new tokens (decodes, speculative verify steps
    of 1 + k tokens) is one `decode_attention` call for the whole step, causal among a request's
    new tokens; it computes in float32 (bf16 rows are widened, the output rounded back).
  * Longer queries (prompt chunks, after a cached prefix or not): one `prefill_attention` call
    each where the build has its vector path for these heads (AVX-512, head dim 64 / 128: ~1.35x
    torch's CPU flash kernel on a 2k-token prompt; AVX2: 1.3-1.45x after a 4k-16k prefix), bf16 chunks one `amx_prefill_attention` call
    each on the avx512amx build (head dim 64; ~0.65x torch's bf16 flash kernel, itself ~2x
    hearth's fp32 kernel); elsewhere the torch backend's SDPA loop.
  * A layer with sinks or a sliding window (`AttentionSpec`; gpt-oss): a step of short queries
    is still one `decode_attention` call (the sinks join each head's softmax when the splits
    merge; a window starts a request's splits at its first key, so it takes one query per
    request); prompt chunks, verify steps under a window and chunked-local attention (Llama 4)
    take the torch backend's `limited` path, RoPE and the cache write still fused.
  * MLA: short queries are `decode_attention` with the latent row as the one KV head (its value
    rows are its key rows: the output's last R values, attention over k_pe, are dropped);
    prompt chunks as the torch backend.

Which ISA build runs, and whether it runs at all, was decided by the probe when the kernels were
loaded; this backend only asks the build what it supports.
"""

from __future__ import annotations

import torch

from hearth.ops import kv_quant
from hearth.ops.attention import CAUSAL, AttentionMetadata, AttentionSpec
from hearth.ops.attention_backends.torch_sdpa import TorchAttentionBackend
from hearth.ops.cpu_kernels import CpuKernels


class CpuKernelAttentionBackend(TorchAttentionBackend):
    name = "cpu_kernels"

    def __init__(self, kernels: CpuKernels) -> None:
        self.kernels = kernels

    def rope_write_kv(self, qkv, positions, cos, sin, k_cache, v_cache, meta: AttentionMetadata,
                      num_heads: int, num_kv_heads: int, head_dim: int,
                      qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None) -> bool:
        if not qkv.is_contiguous():
            return False
        args = (qkv, positions, cos, sin, k_cache, v_cache, meta.slot_mapping, num_heads,
                num_kv_heads, head_dim)
        if qk_norm is None:
            self.kernels.ops.rope_write_kv(*args)
        else:
            self.kernels.ops.qk_norm_rope_write_kv(*args, *qk_norm)
        return True

    def attend(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
               spec: AttentionSpec = CAUSAL) -> torch.Tensor:
        if not spec.is_causal:
            if self._kernel_takes(spec, meta):  # decodes under sinks / a window
                return self.short_queries(q, k_cache, v_cache, meta, scale, spec)
            return self.limited(q, k_cache, v_cache, meta, scale, spec)  # torch's path
        if meta.num_short_tokens == meta.num_tokens:
            # Only short queries in this step: the kernel's output is the whole result.
            return self.short_queries(q, k_cache, v_cache, meta, scale)
        kernels = self.kernels
        out = torch.empty_like(q)
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        op = None  # the chunk over the cache in place, its own K/V included
        if (q.dtype == torch.float32
                and kernels.fast_prefill_attention(q.shape[1], num_kv_heads, head_dim)):
            op = kernels.ops.prefill_attention
        elif (q.dtype == torch.bfloat16 and not kv_quant.is_scaled(k_cache.dtype)
              and kernels.amx_prefill_attention(head_dim)):
            op = kernels.ops.amx_prefill_attention
        for start, q_len, ctx_len, table in zip(meta.prefill_query_starts, meta.prefill_query_lens,
                                                meta.prefill_context_lens, meta.prefill_block_tables):
            if q_len <= meta.short_max:
                continue  # `short_queries` below does it
            rows = slice(start, start + q_len)
            if op is not None:
                out[rows] = op(q[rows], k_cache, v_cache, table, ctx_len, scale,
                               kernels.threads.count)
            else:
                out[rows] = self.prompt_chunk(q[rows], k[rows], v[rows], k_cache, v_cache, table,
                                              ctx_len, scale)
        if meta.num_short_tokens:
            index = meta.short_token_index
            out[index] = self.short_queries(q[index], k_cache, v_cache, meta, scale)
        return out

    @staticmethod
    def _kernel_takes(spec: AttentionSpec, meta: AttentionMetadata) -> bool:
        """Whether `decode_attention` serves this step under `spec`: short queries only, no
        chunked-local limit, and a window only where every request has one query (a verify
        step's queries would each need their own first key)."""
        return (spec.chunk is None and meta.num_tokens > 0
                and meta.num_short_tokens == meta.num_tokens
                and (spec.window is None or meta.num_short_tokens == meta.short_query_lens.numel()))

    def short_queries(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                      spec: AttentionSpec = CAUSAL) -> torch.Tensor:
        """The step's short-query requests (`q`: their rows, request order) in one kernel call
        (with `spec`'s sinks and window where `_kernel_takes` allows them)."""
        kernels = self.kernels
        sinks = None if spec.sinks is None else spec.sinks.float()
        out = kernels.ops.decode_attention(q.float(), k_cache, v_cache, meta.short_block_table_i32,
                                           meta.short_context_lens, scale, kernels.decode_split,
                                           kernels.threads.count, meta.short_query_lens, sinks,
                                           spec.window or 0)
        return out.to(q.dtype)

    def mla_decode(self, q_lat, cache, meta: AttentionMetadata, scale: float,
                   rank: int) -> torch.Tensor:
        kernels = self.kernels
        out = kernels.ops.decode_attention(
            q_lat.float().contiguous(), cache, cache, meta.short_block_table_i32,
            meta.short_context_lens, scale, kernels.decode_split, kernels.threads.count,
            meta.short_query_lens)
        return out[..., :rank]

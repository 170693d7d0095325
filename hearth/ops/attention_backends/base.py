"""The one interface a model reaches attention through.

A model holds one backend, chosen when it is built (`select_attention_backend`), and calls
only these methods: it never names a kernel, and it never asks which device or build it runs
on. Every backend computes the same math; they differ in where (hearth's CPU kernels over the
cache in place, torch's SDPA over gathered blocks) and so in rounding, never in which tokens
attend to which.

Two cache layouts, both paged (`hearth/ops/attention.py` has the slot arithmetic):
  * dense heads (Llama family, GQA): per layer a K and a V plane,
    `[num_blocks, block_size, num_kv_heads, head_dim]` (+ 4 bytes of scale for int8 / fp8 rows);
  * MLA (DeepSeek): per layer one plane of latent rows, `[num_blocks, block_size, 1, L + R]`
    (L = kv_lora_rank, R = qk_rope_head_dim), read two ways: absorbed for short queries, up-
    projected to per-head K/V by the model for prompt chunks (see hearth/models/families/deepseek/model.py).
"""

from __future__ import annotations

from typing import Protocol

import torch

from hearth.ops.attention import CAUSAL, AttentionMetadata, AttentionSpec
from hearth.ops.cpu_kernels import CpuKernels


class AttentionBackend(Protocol):
    name: str  # "torch" | "cpu_kernels" | "cuda": for logs and tests
    # The compiled CPU build this backend calls, else None. A layer that fuses its whole
    # decode step into one kernel call (attention inside it) does so only when this is set.
    kernels: CpuKernels | None

    # ---- dense heads ---------------------------------------------------------------------

    def rope_write_kv(self, qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      meta: AttentionMetadata, num_heads: int, num_kv_heads: int, head_dim: int,
                      qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None) -> bool:
        """In one pass where this backend has one: (Qwen3's per-head q/k RMS norms, `qk_norm` =
        (q weight, k weight, eps),) RoPE on the q and k columns of `qkv` ([T, (H + 2 KVH) D]) in
        place, then k and v into their cache slots. Returns False, having done nothing, where it
        has none: the caller then norms and rotates in torch and calls `write_kv`."""
        ...

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, meta: AttentionMetadata) -> None:
        """This step's K/V rows ([T, KVH, D]) into their slots (`meta.slot_mapping`), rounded
        or quantized to the cache's format."""
        ...

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
               spec: AttentionSpec = CAUSAL) -> torch.Tensor:
        """A step's prompt chunks and decodes ([T, H, D] queries; this step's K/V already in the
        cache, `k`/`v` the same rows unrounded) over the paged cache, causal per request.
        Returns [T, H, D] in q's dtype. A chunk's own keys are read as the cache rounds them, so
        a token attends to the same K/V whether it was computed now or earlier (prefix hit,
        recompute after preemption, PD import). q may be bfloat16 over a float32 cache (a
        many-row step under --prefill-dtype bfloat16): its prompt chunks then attend in bf16.
        `spec`: the layer's sliding window, chunked-local attention and sinks (default plain
        causal); every backend serves them, the CPU kernel one through the torch path."""
        ...

    # ---- MLA (latent cache) --------------------------------------------------------------

    def write_latent(self, c: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor,
                     meta: AttentionMetadata) -> None:
        """Each token's row [c | rope(k_pe)] ([T, L] and [T, R]) into its slot, in the cache's
        dtype."""
        ...

    def mla_decode(self, q_lat: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
                   scale: float, rank: int) -> torch.Tensor:
        """The step's short queries (`meta.short_*`), absorbed: `q_lat` [Ts, H, L + R] (rows in
        request order) attends over the latent rows as one shared head whose key is the whole
        row and whose value its first `rank` (= L) values. Returns [Ts, H, L] (float32 where
        the backend computes in it; the caller rounds)."""
        ...

    def mla_prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    scale: float) -> torch.Tensor:
        """One prompt chunk over its context's up-projected K/V: `q` [H, q, D], `k`/`v`
        [H, ctx, D] (ctx >= q: the chunk is the last q of ctx tokens, the first ctx - q a cached
        prefix), causal. Returns [H, q, D] in q's dtype."""
        ...

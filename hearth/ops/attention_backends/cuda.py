"""Attention on CUDA tensors: the torch path (`TorchAttentionBackend`), SDPA on the GPU.

hearth has no CUDA attention kernels; this backend differs from the CPU one only where the CPU
one calls a CPU-only op: a prompt chunk after a cached prefix is one SDPA call with the offset
causal mask written out (torch's CUDA SDPA takes the mask; the CPU merge of two flash calls
does not run here).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hearth.ops.attention_backends.torch_sdpa import TorchAttentionBackend


class CudaAttentionBackend(TorchAttentionBackend):
    name = "cuda"

    def prefix_chunk(self, q, k, v, prefix: int, scale: float, enable_gqa: bool) -> torch.Tensor:
        q_len, ctx_len = q.shape[1], k.shape[1]
        rows = torch.arange(q_len, device=q.device)[:, None] + prefix
        seen = torch.arange(ctx_len, device=q.device)[None, :] <= rows  # [q, ctx]
        return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=seen,
                                              scale=scale, enable_gqa=enable_gqa)[0]

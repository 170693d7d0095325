"""Attention behind one interface (`AttentionBackend`, base.py), one backend per model.

    backend                      where                         picked when
    CpuKernelAttentionBackend    hearth's CPU kernels          CPU model, a kernel build loaded
    TorchAttentionBackend        torch SDPA on the CPU          CPU model, no kernels
    CudaAttentionBackend         torch SDPA on CUDA             CUDA model

`select_attention_backend` makes that choice once, when the model is built (hearth.models.
weights.build_model for its device, `LlamaForCausalLM.use_kernels` when a build is attached);
which kernel ISA runs was settled by the probe that loaded the build (cpu_kernels.py). Per step
a backend still looks at what varies by step: the query dtype (bf16 prompt chunks), the cache
dtype, how many new tokens each request has.
"""

from __future__ import annotations

import torch

from hearth.ops.attention_backends.base import AttentionBackend
from hearth.ops.attention_backends.cpu_kernel import CpuKernelAttentionBackend
from hearth.ops.attention_backends.cuda import CudaAttentionBackend
from hearth.ops.attention_backends.torch_sdpa import TorchAttentionBackend
from hearth.ops.cpu_kernels import CpuKernels

__all__ = ["AttentionBackend", "CpuKernelAttentionBackend", "CudaAttentionBackend",
           "TorchAttentionBackend", "select_attention_backend"]


def select_attention_backend(device: torch.device | str,
                             kernels: CpuKernels | None = None) -> AttentionBackend:
    """The backend for a model on `device`: the CPU kernels where a build is given and the
    model runs on the CPU, else torch on the model's device."""
    device = torch.device(device)
    if device.type == "cpu":
        return TorchAttentionBackend() if kernels is None else CpuKernelAttentionBackend(kernels)
    if device.type == "cuda":
        return CudaAttentionBackend()
    raise ValueError(f"no attention backend for device {device} (hearth runs on cpu or cuda)")

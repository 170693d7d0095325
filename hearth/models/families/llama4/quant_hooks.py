"""Llama 4's quantization hooks (hearth/models/quant.py): the Llama attention's linears, except
that a RoPE layer's QKV rows are permuted at load (interleaved pairs -> rotate-half, loading.py),
so a GGUF's stored blocks are in the wrong row order for it: it is quantized from the float
weights (no sources) instead. A NoPE layer's QKV and every o_proj take the file's blocks. The
MLPs are named under feed_forward. (`MLP_NAMES`), so a GGUF's dense MLPs, shared experts and
routed expert stacks are packed from its blocks too."""

from __future__ import annotations

import torch

from hearth.models.quant import attention_linears as llama_attention_linears


MLP_NAMES = ("feed_forward.", "feed_forward.shared_expert.", "feed_forward.experts.")


def attention_linears(attn, p: str) -> list[tuple[torch.nn.Module, list[str]]]:
    linears = llama_attention_linears(attn, p)
    if not attn.use_rope:
        return linears
    return [(module, [] if module is attn.qkv_proj else sources) for module, sources in linears]


def quantize_attention(model, kernels, int8_act: bool = False) -> dict[str, int]:
    return {}

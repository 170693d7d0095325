"""MLA's quantization hooks (`Family.quant`; hearth/models/quant.py calls them): which linears
take packed copies, and Q8_0 copies of the absorbed up-projections for decode steps."""

from __future__ import annotations

import torch

from hearth.models.quant import quantize_q8_0
from hearth.ops.cpu_kernels import QTYPE_IDS, pack_ggml_parts


def attention_linears(attn, p: str) -> list[tuple[torch.nn.Module, list[str]]]:
    """MLA's linears, with no stored blocks (sources []): rotary rows are permuted at load, so
    the float weights are what the kernels must see. kv_b_proj stays float: decode absorbs it
    into the query and output, only prompts multiply by it (float GEMMs)."""
    return [(m, []) for m in (attn.qkv_a_proj, attn.q_b_proj, attn.q_proj, attn.o_proj)
            if m is not None]


def quantize_attention(model, kernels, int8_act: bool = False) -> dict[str, int]:
    return quantize_absorb(model, kernels, int8_act)


def quantize_absorb(model, kernels, int8_act: bool = False) -> dict[str, int]:
    """Give each MLA layer Q8_0 copies of its absorbed up-projections for few-row steps:
    W_UK_h^T ([H L, nope]: a query's nope part to the latent) and W_UV_h ([H v, L]: the
    attended latent to the head's values), both cut from kv_b_proj's rows. They are the only
    float32 weights a decode step would otherwise read (25 of the 190 MB of the bench model's
    step). Heads whose widths are not multiples of 32 keep the float path."""
    counts: dict[str, int] = {}
    for layer in model.layers:
        attn = layer.self_attn
        if attn.nope % 32 or attn.rank % 32:
            counts["none"] = counts.get("none", 0) + 1
            continue
        kv_b = attn._kv_b().detach().float()  # [H, nope + v, L]
        uk = kv_b[:, : attn.nope].transpose(1, 2).reshape(-1, attn.nope)  # [H L, nope]
        uv = kv_b[:, attn.nope:].reshape(-1, attn.rank)  # [H v, L]
        q8 = QTYPE_IDS["q8_0"]
        attn.set_quantized_absorb(
            *(pack_ggml_parts(q8, [quantize_q8_0(w)], [w.shape[0]], 1, int8_act) for w in (uk, uv)),
            kernels)
        counts["absorbed-q8_0"] = counts.get("absorbed-q8_0", 0) + 1
    return counts

"""Where Mixtral's and Qwen3-MoE's checkpoint tensors go: the Llama layer's, with a sparse
layer's router and experts in any of the layouts hearth.models.weights.load_moe_block reads."""

from __future__ import annotations

from hearth.models.families.llama import loading as llama
from hearth.models.weights import WeightLoader, load_moe_block


def load_weights(model, loader: WeightLoader) -> None:
    llama.load_weights(model, loader, load_layer)


def load_layer(model, loader: WeightLoader, index: int, layer) -> None:
    p = f"model.layers.{index}."
    llama.load_norms(loader, layer, p)
    llama.load_attention(loader, layer.self_attn, p)
    if model.arch.is_moe_layer(index):
        load_moe_block(layer.mlp, loader, p)
    else:
        llama.load_mlp(loader, layer.mlp, p + "mlp.")

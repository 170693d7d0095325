"""Where DeepSeek's (and Kimi K2's) checkpoint tensors go: MLA's projections, with the rotary
rows of q and k_pe permuted from DeepSeek's interleaved pairs to rotate-half; in sparse layers
the routed experts (hearth.models.weights.load_moe_block), the router's correction bias and
the shared experts; the rest as the Llama family loads it."""

from __future__ import annotations

from hearth.models.families.deepseek.model import interleaved_to_half
from hearth.models.families.llama import loading as llama
from hearth.models.weights import WeightLoader, load_moe_block


def load_weights(model, loader: WeightLoader) -> None:
    llama.load_weights(model, loader, load_layer)


def load_layer(model, loader: WeightLoader, index: int, layer) -> None:
    p = f"model.layers.{index}."
    llama.load_norms(loader, layer, p)
    load_mla(loader, layer.self_attn, p)
    mlp = layer.mlp
    if not model.arch.is_moe_layer(index):
        llama.load_mlp(loader, mlp, p + "mlp.")
        return
    load_moe_block(mlp, loader, p)
    if mlp.e_score_correction_bias is not None:
        loader.fill(mlp.e_score_correction_bias, p + "mlp.gate.e_score_correction_bias")
    if mlp.shared_experts is not None:
        llama.load_mlp(loader, mlp.shared_experts, p + "mlp.shared_experts.")


def load_mla(loader: WeightLoader, attn, p: str) -> None:
    """MLA's projections (q_a and kv_a merged into qkv_a_proj's rows); the rotary rows of q and
    k_pe from interleaved to rotate-half."""
    a = p + "self_attn."
    parts = [(a + "kv_a_proj_with_mqa.{}", None, attn.latent_dim)]
    if attn.q_lora_rank:
        parts.insert(0, (a + "q_a_proj.{}", None, attn.q_lora_rank))
        loader.fill(attn.q_a_layernorm.weight, a + "q_a_layernorm.weight")
        loader.fill(attn.q_b_proj.weight, a + "q_b_proj.weight", 0)
        q_weight = attn.q_b_proj.weight.data
    else:
        loader.fill(attn.q_proj.weight, a + "q_proj.weight", 0)
        q_weight = attn.q_proj.weight.data
    for kind, param in (("weight", attn.qkv_a_proj.weight), ("bias", attn.qkv_a_proj.bias)):
        if param is not None:
            loader.fill_rows(param, [(n.format(kind), s, r) for n, s, r in parts])
    loader.fill(attn.kv_a_layernorm.weight, a + "kv_a_layernorm.weight")
    loader.fill(attn.kv_b_proj.weight, a + "kv_b_proj.weight", 0)
    loader.fill(attn.o_proj.weight, a + "o_proj.weight", 1)
    if attn.o_proj.bias is not None:
        loader.fill(attn.o_proj.bias, a + "o_proj.bias")
    if loader.arch.mla.rope_interleave:
        perm = interleaved_to_half(attn.rope)
        heads = q_weight.view(attn.num_heads, attn.qk_dim, -1)
        heads[:, attn.nope:] = heads[:, attn.nope:][:, perm].clone()
        for param in (attn.qkv_a_proj.weight, attn.qkv_a_proj.bias):
            if param is not None:
                param.data[-attn.rope:] = param.data[-attn.rope:][perm].clone()

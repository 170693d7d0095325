"""Where the Llama family's checkpoint tensors go (HF names; hearth.models.weights.WeightLoader
reads this rank's shards). Merged projections are filled part by part:

    qkv_proj.weight rows = [ q heads of this rank | k heads | v heads ]
    gate_up_proj.weight rows = [ gate slice | up slice ]

The families built on the Llama decoder (moe_llama, deepseek) reuse these pieces and pass their
own `load_layer`.
"""

from __future__ import annotations

from typing import Callable

from hearth.models.weights import WeightLoader


def load_weights(model, loader: WeightLoader, load_layer: Callable | None = None) -> None:
    """Every tensor of this model part: the ends (embeddings, final norm, head) and each decoder
    layer through `load_layer(model, loader, index, layer)` (default: the Llama layer; `index`
    counts from the model's first layer, not the stage's), as independent tasks
    (WeightLoader.run)."""
    load_layer = load_layer or load_decoder_layer
    tasks = [lambda: load_ends(model, loader)] + [
        lambda i=i, layer=layer: load_layer(model, loader, model.layer_start + i, layer)
        for i, layer in enumerate(model.layers)]
    loader.run(tasks)


def load_decoder_layer(model, loader: WeightLoader, index: int, layer) -> None:
    p = f"model.layers.{index}."
    load_norms(loader, layer, p)
    load_attention(loader, layer.self_attn, p)
    load_mlp(loader, layer.mlp, p + "mlp.")


def load_norms(loader: WeightLoader, layer, p: str) -> None:
    loader.fill(layer.input_layernorm.weight, p + "input_layernorm.weight")
    loader.fill(layer.post_attention_layernorm.weight, p + "post_attention_layernorm.weight")


def load_ends(model, loader: WeightLoader) -> None:
    """The embeddings (first stage), the final norm and the LM head (last stage). A tied head
    on one rank copies the decoded embedding rather than decoding it again."""
    arch = model.arch
    names = set(loader.tensor_names())
    head_name = ("lm_head.weight" if "lm_head.weight" in names and not arch.tie_word_embeddings
                 else "model.embed_tokens.weight")
    if loader.size == 1:
        if model.embed_tokens is not None:
            loader.fill(model.embed_tokens.weight, "model.embed_tokens.weight")
        if model.lm_head is not None:
            if head_name == "model.embed_tokens.weight" and model.embed_tokens is not None:
                # tied: decoded once. A copy, not a shared parameter: a format may rewrite the
                # head's float weight (hearth/models/quant.py) and must not touch the embedding.
                loader.read.add(head_name)
                model.lm_head.weight.data.copy_(model.embed_tokens.weight.data)
            else:
                loader.fill(model.lm_head.weight, head_name)
    else:
        if model.embed_tokens is not None:
            loader.fill_vocab_rows(model.embed_tokens.weight, "model.embed_tokens.weight")
        if model.lm_head is not None:
            loader.fill_vocab_rows(model.lm_head.weight, head_name)
    if model.norm is not None:
        loader.fill(model.norm.weight, "model.norm.weight")


def load_attention(loader: WeightLoader, attn, p: str) -> None:
    """LlamaAttention: merged QKV (K/V rows per KV-head sharding), o_proj, biases and q/k norms
    where the arch has them."""
    arch = loader.arch
    q_rows, kv_rows = attn.q_size, attn.kv_size
    for kind, param in (("weight", attn.qkv_proj.weight),
                        ("bias", attn.qkv_proj.bias if arch.attention_bias else None)):
        if param is not None:
            loader.fill_rows(param, [(*loader.part(p + f"self_attn.q_proj.{kind}", 0), q_rows),
                                     (*loader.kv_part(p + f"self_attn.k_proj.{kind}"), kv_rows),
                                     (*loader.kv_part(p + f"self_attn.v_proj.{kind}"), kv_rows)])
    loader.fill(attn.o_proj.weight, p + "self_attn.o_proj.weight", 1)
    if arch.attention_out_bias:
        loader.fill(attn.o_proj.bias, p + "self_attn.o_proj.bias")
    if arch.qk_norm:
        loader.fill(attn.q_norm.weight, p + "self_attn.q_norm.weight")
        loader.fill(attn.k_norm.weight, p + "self_attn.k_norm.weight")


def load_mlp(loader: WeightLoader, mlp, m: str) -> None:
    """A SiLU-gated LlamaMLP under prefix `m`: merged gate/up rows, down_proj cut by columns."""
    mlp_bias = loader.arch.mlp_bias
    inter = mlp.gate_up_proj.weight.shape[0] // 2
    for kind, param in (("weight", mlp.gate_up_proj.weight),
                        ("bias", mlp.gate_up_proj.bias if mlp_bias else None)):
        if param is not None:
            loader.fill_rows(param, [(*loader.part(m + f"gate_proj.{kind}", 0), inter),
                                     (*loader.part(m + f"up_proj.{kind}", 0), inter)])
    loader.fill(mlp.down_proj.weight, m + "down_proj.weight", 1)
    if mlp_bias:
        loader.fill(mlp.down_proj.bias, m + "down_proj.bias")

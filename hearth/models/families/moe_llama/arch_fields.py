"""Mixtral's and Qwen3-MoE's parts of a ModelArch: the Llama family's attention fields and the
sparse MLP's MoeSpec, from config.json or from a GGUF's expert keys."""

from __future__ import annotations

from typing import Any

from hearth.models.specs import MoeSpec
from hearth.models.families.llama.arch_fields import attention_fields


def hf_fields(config: dict[str, Any], architecture: str, folder) -> dict[str, Any]:
    return {**attention_fields(config, architecture),
            "moe": _hf_moe_spec(config, architecture, folder)}


def _hf_moe_spec(config: dict[str, Any], architecture: str, folder) -> MoeSpec:
    """Mixtral: num_local_experts of intermediate_size, top-k renormalised, every layer sparse.
    Qwen3-MoE: num_experts of moe_intermediate_size, norm_topk_prob, and dense layers where
    mlp_only_layers says or (layer + 1) is not a multiple of decoder_sparse_step."""
    if architecture == "mixtral":
        return MoeSpec(num_experts=int(config["num_local_experts"]),
                       num_experts_per_tok=int(config["num_experts_per_tok"]),
                       expert_intermediate_size=int(config["intermediate_size"]))
    if config.get("router_type") not in (None, "softmax"):
        raise ValueError(f"{folder}: unknown router_type {config['router_type']!r} (hearth's "
                         f"{architecture} router is softmax top-k)")
    num_layers, step = int(config["num_hidden_layers"]), int(config.get("decoder_sparse_step") or 1)
    only_dense = {int(i) for i in config.get("mlp_only_layers") or ()}
    # transformers 5 writes Qwen3-MoE's num_experts as num_local_experts
    num_experts = int(config.get("num_experts", config.get("num_local_experts", 0)))
    dense = tuple(i for i in range(num_layers)
                  if i in only_dense or num_experts == 0 or (i + 1) % step)
    return MoeSpec(num_experts=max(num_experts, 1),
                   num_experts_per_tok=int(config["num_experts_per_tok"]),
                   expert_intermediate_size=int(config["moe_intermediate_size"]),
                   norm_topk_prob=bool(config.get("norm_topk_prob", False)),
                   dense_layers=dense)


def gguf_fields(meta: dict[str, Any], file, key, architecture: str) -> dict[str, Any]:
    """The stacked experts' keys (expert_count, expert_used_count, expert_feed_forward_length);
    a layer without a router (ffn_gate_inp) is dense. llama.cpp renormalises the top-k weights
    of both (its qwen3moe and llama graphs)."""
    prefix = meta["general.architecture"]
    gate = file.tensors.get("blk.0.ffn_gate_exps.weight")
    expert_width = meta.get(f"{prefix}.expert_feed_forward_length",
                            gate.shape[1] if gate is not None else None)
    return {"moe": MoeSpec(
        num_experts=int(key("expert_count")),
        num_experts_per_tok=int(key("expert_used_count")),
        expert_intermediate_size=int(expert_width or key("feed_forward_length")),
        norm_topk_prob=True,
        dense_layers=tuple(i for i in range(int(key("block_count")))
                           if f"blk.{i}.ffn_gate_inp.weight" not in file.tensors))}

"""DeepSeek-V2/V3's (and Kimi K2's) parts of a ModelArch from config.json: the MlaSpec and the
grouped router's MoeSpec (the GGUF side: gguf.py)."""

from __future__ import annotations

from typing import Any

from hearth.models.specs import MlaSpec, MoeSpec
from hearth.models.families.llama.arch_fields import attention_fields


def hf_fields(config: dict[str, Any], architecture: str, folder) -> dict[str, Any]:
    mla = mla_spec(config, architecture)
    num_heads = int(config["num_attention_heads"])
    # every head has its own K and V (from the shared latent); head_dim is its qk width
    return {**attention_fields(config, architecture), "mla": mla,
            "moe": moe_spec(config, architecture), "num_kv_heads": num_heads,
            "head_dim": mla.qk_head_dim}


def mla_spec(config: dict[str, Any], architecture: str) -> MlaSpec:
    q_lora = config.get("q_lora_rank")
    return MlaSpec(kv_lora_rank=int(config["kv_lora_rank"]),
                   qk_nope_head_dim=int(config["qk_nope_head_dim"]),
                   qk_rope_head_dim=int(config["qk_rope_head_dim"]),
                   v_head_dim=int(config["v_head_dim"]),
                   q_lora_rank=None if q_lora is None else int(q_lora),
                   # DeepSeek-V2 is always interleaved; V3's transformers config says
                   rope_interleave=(architecture == "deepseek_v2"
                                    or bool(config.get("rope_interleave", True))))


def moe_spec(config: dict[str, Any], architecture: str) -> MoeSpec:
    """n_routed_experts of moe_intermediate_size, n_shared_experts, dense below
    first_k_dense_replace (and off the moe_layer_freq beat), the grouped router.
    transformers' configs carry no scoring_func / topk_method: V3's are sigmoid + noaux_tc,
    V2's softmax + greedy."""
    v3 = architecture == "deepseek_v3"
    num_layers = int(config["num_hidden_layers"])
    first_dense = int(config.get("first_k_dense_replace") or 0)
    freq = int(config.get("moe_layer_freq") or 1)
    num_experts = int(config.get("n_routed_experts") or config.get("num_local_experts")
                      or config.get("num_experts") or 0)
    if num_experts < 1:
        raise ValueError(f"{architecture}: n_routed_experts missing (a dense DeepSeek model "
                         f"is not supported)")
    return MoeSpec(
        num_experts=num_experts,
        num_experts_per_tok=int(config["num_experts_per_tok"]),
        expert_intermediate_size=int(config["moe_intermediate_size"]),
        norm_topk_prob=bool(config.get("norm_topk_prob", v3)),
        dense_layers=tuple(i for i in range(num_layers) if i < first_dense or i % freq),
        scoring_func=str(config.get("scoring_func") or ("sigmoid" if v3 else "softmax")),
        topk_method=str(config.get("topk_method") or ("noaux_tc" if v3 else "greedy")),
        n_group=int(config.get("n_group") or 1),
        topk_group=int(config.get("topk_group") or 1),
        routed_scaling_factor=float(config.get("routed_scaling_factor") or 1.0),
        num_shared_experts=int(config.get("n_shared_experts") or 0))

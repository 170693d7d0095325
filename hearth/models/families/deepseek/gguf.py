"""llama.cpp's `deepseek2` GGUF files (DeepSeek-V2/V3, Kimi K2) -> hearth's MlaSpec and MoeSpec,
the GGUF side of arch_fields.py, and the family's tensor names beyond the Llama set (MLA's
projections, the shared experts, the router's correction bias). The split `attn_k_b` /
`attn_v_b` form of kv_b_proj is joined in hearth/models/gguf_loader.py for every MLA family.

llama.cpp runs deepseek2 with interleaved-pair RoPE, as DeepSeek's own weights are laid out, so
its converter leaves the rotary rows alone: they stay interleaved (`MlaSpec.rope_interleave`)
and the family's weight loader permutes them, as for the HF folder."""

from __future__ import annotations

from typing import Any

from hearth.models.specs import MlaSpec, MoeSpec
from hearth.models.gguf_file import GGUFFile

# GGUF name of the router's correction bias (noaux_tc) -> its HF name under a layer
CORRECTION_BIAS = ("exp_probs_b", "mlp.gate.e_score_correction_bias")
_PROJECTIONS = {
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
# GGUF block tensor ("name.kind" after "blk.{i}.") -> HF name after "model.layers.{i}."
TENSOR_NAMES = {**{f"{g}.{kind}": f"{h}.{kind}" for g, h in _PROJECTIONS.items()
                   for kind in ("weight", "bias")},
                f"{CORRECTION_BIAS[0]}.bias": CORRECTION_BIAS[1]}


def gguf_fields(meta: dict[str, Any], file: GGUFFile, key, architecture: str) -> dict[str, Any]:
    """MLA and the grouped router; a file whose router scores by sigmoid is DeepSeek-V3 (or
    Kimi K2), V2's is a softmax. MLA: every head has its own K and V, up-projected from the
    latent (llama.cpp's head_count_kv says 1 in newer files: its absorbed attention is MQA over
    the latent)."""
    mla, moe = deepseek_mla_spec(file, key), deepseek_moe_spec(meta, file, key)
    return {"architecture": "deepseek_v3" if moe.scoring_func == "sigmoid" else architecture,
            "mla": mla, "moe": moe, "head_dim": mla.qk_head_dim,
            "num_kv_heads": int(key("attention.head_count"))}


def deepseek_mla_spec(file: GGUFFile, key) -> MlaSpec:
    """deepseek2's attention keys -> MlaSpec (arch_fields.py's mla_spec, from the GGUF side).

    Newer converters describe the absorbed form llama.cpp runs (key_length = kv_lora_rank +
    rope, value_length = kv_lora_rank) and put the per-head widths in key_length_mla /
    value_length_mla; older files have only key_length / value_length, the per-head widths.
    The rotary rows stay interleaved (module docstring)."""
    meta = file.metadata
    prefix = meta["general.architecture"]
    mla_widths = (meta.get(f"{prefix}.attention.key_length_mla"),
                  meta.get(f"{prefix}.attention.value_length_mla"))
    qk_head_dim, v_head_dim = (
        (int(mla_widths[0]), int(mla_widths[1])) if None not in mla_widths
        else (int(key("attention.key_length")), int(key("attention.value_length"))))
    rope = int(key("rope.dimension_count"))
    has_q_lora = "blk.0.attn_q_a.weight" in file.tensors
    return MlaSpec(kv_lora_rank=int(key("attention.kv_lora_rank")),
                   qk_nope_head_dim=qk_head_dim - rope,
                   qk_rope_head_dim=rope,
                   v_head_dim=v_head_dim,
                   q_lora_rank=int(key("attention.q_lora_rank")) if has_q_lora else None,
                   rope_interleave=True)


# expert_gating_func (llama.cpp's llama_expert_gating_func_type) -> MoeSpec.scoring_func;
# files without it are DeepSeek V2 / V2.5, softmax
_GATING_FUNCS = {1: "softmax", 2: "sigmoid"}


def deepseek_moe_spec(meta: dict[str, Any], file: GGUFFile, key) -> MoeSpec:
    """deepseek2's expert keys -> MoeSpec (arch_fields.py's moe_spec, from the GGUF side).

    The file has no topk_method: V3's noaux_tc is told by the router's correction bias
    (exp_probs_b), V2's group-limited greedy by expert groups without one. Dense layers are the
    leading_dense_block_count first, as llama.cpp runs them."""
    prefix = meta["general.architecture"]
    gating = int(meta.get(f"{prefix}.expert_gating_func") or 1)
    if gating not in _GATING_FUNCS:
        raise ValueError(f"{file.path}: {prefix}.expert_gating_func={gating} is not supported "
                         f"(1 softmax, 2 sigmoid)")
    num_layers, first_dense = int(key("block_count")), int(key("leading_dense_block_count"))
    n_group = int(meta.get(f"{prefix}.expert_group_count") or 1)
    has_bias = any(f"blk.{i}.{CORRECTION_BIAS[0]}.bias" in file.tensors
                   for i in range(first_dense, num_layers))
    return MoeSpec(
        num_experts=int(key("expert_count")),
        num_experts_per_tok=int(key("expert_used_count")),
        expert_intermediate_size=int(key("expert_feed_forward_length")),
        norm_topk_prob=bool(meta.get(f"{prefix}.expert_weights_norm", False)),
        dense_layers=tuple(range(min(first_dense, num_layers))),
        scoring_func=_GATING_FUNCS[gating],
        topk_method="noaux_tc" if has_bias else ("group_limited_greedy" if n_group > 1
                                                 else "greedy"),
        n_group=n_group,
        topk_group=int(meta.get(f"{prefix}.expert_group_used_count") or 1),
        routed_scaling_factor=float(meta.get(f"{prefix}.expert_weights_scale") or 1.0),
        num_shared_experts=int(key("expert_shared_count")))

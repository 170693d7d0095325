"""llama.cpp's `gpt-oss` GGUF files -> gpt-oss's ModelArch fields and tensor names.

llama.cpp's converter (GptOssModel) splits the experts' interleaved gate/up columns into
`ffn_gate_exps` / `ffn_up_exps` [E, I, H] (biases [E, I]) and stores `ffn_down_exps` [E, H, I],
nn.Linear rows, either as OpenAI's MXFP4 blocks (re-nibbled into ggml's MXFP4 layout, which
hearth's dequant reads) or as floats / other block formats. They are read here under the
stacked names `mlp.experts.{gate,up,down}_proj` (+ `_bias`), which the family's loader takes
beside transformers' `gate_up_proj`. The sinks are `attn_sinks`, the norm before the MLP
`post_attention_norm`, the biased router `ffn_gate_inp`. RoPE is NeoX-style (rotate-half), so
no rows were permuted.

The file does not say which layers slide: llama.cpp runs gpt-oss with a window on even layers
(its swa pattern 2), as transformers' default layer_types does; a file with an
`attention.sliding_window_pattern` array is read by it instead. The SwiGLU alpha is llama.cpp's
constant (1.702), the limit its constant 7.0 (the released models') unless the file has a
per-layer `swiglu_clamp_exp` array (one value for every layer: hearth's spec holds one).
"""

from __future__ import annotations

from typing import Any

from hearth.models.families.gpt_oss.arch_fields import GptOssSpec
from hearth.models.specs import MoeSpec

_EXPERTS = {f"ffn_{x}_exps": f"mlp.experts.{x}_proj" for x in ("gate", "up", "down")}
# GGUF block tensor ("name.kind" after "blk.{i}.") -> HF name after "model.layers.{i}."
TENSOR_NAMES = {
    "attn_sinks.weight": "self_attn.sinks",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate_inp.weight": "mlp.router.weight",
    "ffn_gate_inp.bias": "mlp.router.bias",
    **{f"{g}.weight": h for g, h in _EXPERTS.items()},
    **{f"{g}.bias": h + "_bias" for g, h in _EXPERTS.items()},
}


def gguf_fields(meta: dict[str, Any], file, key, architecture: str) -> dict[str, Any]:
    """gpt-oss's keys: every layer a MoE of expert_count experts of expert_feed_forward_length,
    expert_used_count a token (softmax over their logits); biases on q/k/v/o; the window
    (`attention.sliding_window`) on the pattern's layers (module docstring); YaRN as the
    released config has it (no truncation of its ramp)."""
    prefix = meta["general.architecture"]
    num_layers = int(key("block_count"))
    pattern = meta.get(f"{prefix}.attention.sliding_window_pattern")
    if isinstance(pattern, (list, tuple)):
        if len(pattern) < num_layers:
            raise ValueError(f"{file.path}: {prefix}.attention.sliding_window_pattern has "
                             f"{len(pattern)} entries for {num_layers} layers")
        sliding = tuple(bool(pattern[i]) for i in range(num_layers))
    else:
        every = int(pattern or 2)  # llama.cpp: layer i slides unless i % n == n - 1
        sliding = tuple(i % every < every - 1 for i in range(num_layers))
    limits = meta.get(f"{prefix}.swiglu_clamp_exp") or [7.0] * num_layers
    if len(set(float(x) for x in limits[:num_layers])) != 1 or len(limits) < num_layers:
        raise ValueError(f"{file.path}: {prefix}.swiglu_clamp_exp {list(limits)} is not one "
                         f"limit for each of the {num_layers} layers")
    spec = GptOssSpec(sliding_layers=sliding,
                      sliding_window=int(key("attention.sliding_window")),
                      swiglu_limit=float(limits[0]))
    moe = MoeSpec(num_experts=int(key("expert_count")),
                  num_experts_per_tok=int(key("expert_used_count")),
                  expert_intermediate_size=int(key("expert_feed_forward_length")),
                  norm_topk_prob=True)
    fields = {"attention_bias": "blk.0.attn_q.bias" in file.tensors,
              "attention_out_bias": "blk.0.attn_output.bias" in file.tensors,
              "qk_norm": False, "moe": moe, "family_spec": spec}
    if meta.get(f"{prefix}.rope.scaling.type", "none") == "yarn":
        fields["rope_scaling"] = {
            "rope_type": "yarn", "factor": float(key("rope.scaling.factor")),
            "original_max_position_embeddings": int(key("rope.scaling.original_context_length")),
            "beta_fast": float(meta.get(f"{prefix}.rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(meta.get(f"{prefix}.rope.scaling.yarn_beta_slow", 1.0)),
            "truncate": False}
    return fields

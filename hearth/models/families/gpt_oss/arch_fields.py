"""gpt-oss's parts of a ModelArch: its MoE (MoeSpec) and its per-layer attention and expert
activation (`GptOssSpec`, the arch's family_spec), from config.json (transformers'
GptOssConfig); the GGUF side is gguf.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hearth.models.specs import MoeSpec

LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass(frozen=True)
class GptOssSpec:
    """What only gpt-oss's layers read (transformers' GptOssAttention, GptOssExperts):

    * `sliding_layers[i]`: layer i attends to the last `sliding_window` keys only (the query's
      own included: key j is seen from query i when i - window < j <= i), else all of them;
      every layer adds its heads' learned sinks to the softmax.
    * the experts' clamped SwiGLU: gate <= limit, -limit <= up <= limit,
      out = (up + 1) * gate * sigmoid(alpha * gate).
    """

    sliding_layers: tuple[bool, ...]
    sliding_window: int | None
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    def __post_init__(self) -> None:
        if any(self.sliding_layers) and (self.sliding_window is None or self.sliding_window < 1):
            raise ValueError(f"sliding_attention layers need a sliding_window of at least 1, "
                             f"got {self.sliding_window}")
        if self.swiglu_limit <= 0:
            raise ValueError(f"swiglu_limit must be positive, got {self.swiglu_limit}")


def hf_fields(config: dict[str, Any], architecture: str, folder) -> dict[str, Any]:
    """GptOssConfig: layer_types (default: sliding on even layers, full on odd ones, as
    transformers fills it), attention_bias on all four projections (default on), every layer
    sparse: num_local_experts of intermediate_size, num_experts_per_tok of them per token."""
    num_layers = int(config["num_hidden_layers"])
    layer_types = config.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)]
    if len(layer_types) < num_layers:
        raise ValueError(f"{folder}: layer_types has {len(layer_types)} entries for "
                         f"{num_layers} layers")
    unknown = sorted(set(layer_types[:num_layers]) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"{folder}: unknown layer_types {unknown} (gpt-oss layers are "
                         f"{' or '.join(LAYER_TYPES)})")
    window = config.get("sliding_window")
    spec = GptOssSpec(
        sliding_layers=tuple(t == "sliding_attention" for t in layer_types[:num_layers]),
        sliding_window=None if window is None else int(window),
        swiglu_alpha=float(config.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(config.get("swiglu_limit", 7.0)))
    num_experts = int(config.get("num_local_experts", config.get("num_experts", 0)))
    moe = MoeSpec(num_experts=num_experts,
                  num_experts_per_tok=int(config.get("num_experts_per_tok",
                                                     config.get("experts_per_token", 4))),
                  expert_intermediate_size=int(config["intermediate_size"]),
                  # a softmax over the top-k logits: the top-k of the full softmax, renormalised
                  norm_topk_prob=True)
    bias = bool(config.get("attention_bias", True))
    return {"attention_bias": bias, "attention_out_bias": bias, "qk_norm": False,
            "moe": moe, "family_spec": spec}


"""Llama 4's parts of a ModelArch: its MoE (MoeSpec) and its per-layer attention (`Llama4Spec`,
the arch's family_spec), from config.json's text config (the GGUF side: gguf.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hearth.models.families.llama.arch_fields import attention_fields
from hearth.models.specs import MoeSpec


@dataclass(frozen=True)
class Llama4Spec:
    """How each decoder layer attends (transformers' Llama4TextAttention):

    * RoPE layers (`rope_layers[i]`): RoPE on the checkpoint's interleaved pairs (the loader
      permutes q/k rows to hearth's rotate-half), a weightless RMS norm of q and k per head
      (`qk_norm`), and chunked-local attention where `chunked_layers[i]`: a token sees only the
      keys of its own `attention_chunk_size`-token chunk.
    * NoPE layers: no RoPE, full causal attention, and with `temperature_tuning` queries scaled
      by 1 + attn_scale * log(1 + floor((position + 1) / floor_scale)).
    """

    rope_layers: tuple[bool, ...]
    chunked_layers: tuple[bool, ...]
    attention_chunk_size: int | None
    qk_norm: bool
    temperature_tuning: bool
    floor_scale: float
    attn_scale: float

    def __post_init__(self) -> None:
        if self.attention_chunk_size is not None and self.attention_chunk_size < 1:
            raise ValueError(f"attention_chunk_size must be at least 1, got "
                             f"{self.attention_chunk_size}")
        if self.temperature_tuning and self.floor_scale <= 0:
            raise ValueError(f"floor_scale must be positive, got {self.floor_scale}")

    def check_block_size(self, block_size: int) -> None:
        """A chunk must be whole cache blocks: a chunked layer then reads only the blocks of
        the chunk a query is in, and every block is wholly inside or outside it."""
        chunk = self.attention_chunk_size
        if any(self.chunked_layers) and chunk % block_size:
            raise ValueError(f"attention_chunk_size={chunk} is not a multiple of the KV cache "
                             f"block size {block_size} (--block-size): Llama 4's chunked "
                             f"attention needs whole blocks per chunk")


def hf_fields(config: dict[str, Any], architecture: str, folder) -> dict[str, Any]:
    """Llama4TextConfig: dense layers of intermediate_size_mlp, experts and the shared expert of
    intermediate_size; MoE layers from moe_layers or every interleave_moe_layer_step-th layer;
    RoPE layers from no_rope_layers (1: RoPE) or all but every no_rope_layer_interval-th."""
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{folder}: hidden_act {config['hidden_act']!r} (hearth's Llama 4 "
                         f"MLPs are SiLU-gated)")
    num_layers = int(config["num_hidden_layers"])
    step = int(config.get("interleave_moe_layer_step") or 1)
    moe_layers = config.get("moe_layers")
    if moe_layers is None:
        moe_layers = range(step - 1, num_layers, step)
    moe_layers = {int(i) for i in moe_layers}
    interval = int(config.get("no_rope_layer_interval") or 4)
    rope = config.get("no_rope_layers") or [int((i + 1) % interval != 0)
                                            for i in range(num_layers)]
    if len(rope) < num_layers:
        raise ValueError(f"{folder}: no_rope_layers has {len(rope)} entries for {num_layers} "
                         f"layers")
    rope_layers = tuple(bool(rope[i]) for i in range(num_layers))
    chunk = config.get("attention_chunk_size")
    chunk = None if chunk is None else int(chunk)
    layer_types = config.get("layer_types") or [
        "chunked_attention" if r and chunk is not None else "full_attention" for r in rope_layers]
    chunked = tuple(layer_types[i] == "chunked_attention" for i in range(num_layers))
    if any(chunked) and chunk is None:
        raise ValueError(f"{folder}: chunked_attention layers without attention_chunk_size")
    spec = Llama4Spec(
        rope_layers=rope_layers, chunked_layers=chunked, attention_chunk_size=chunk,
        qk_norm=bool(config.get("use_qk_norm", True)),
        temperature_tuning=bool(config.get("attn_temperature_tuning", True)),
        floor_scale=float(config.get("floor_scale", 8192)),
        attn_scale=float(config.get("attn_scale", 0.1)))
    num_experts = int(config.get("num_local_experts", 16))
    moe = MoeSpec(num_experts=num_experts,
                  num_experts_per_tok=int(config.get("num_experts_per_tok", 1)),
                  expert_intermediate_size=int(config["intermediate_size"]),
                  norm_topk_prob=False, scoring_func="sigmoid",
                  dense_layers=tuple(i for i in range(num_layers) if i not in moe_layers),
                  num_shared_experts=1)
    return {**attention_fields(config, architecture),
            "intermediate_size": int(config.get("intermediate_size_mlp", 16384)),
            "moe": moe, "family_spec": spec}


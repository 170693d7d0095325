"""The Llama family's parts of a ModelArch: which projections carry biases and whether heads
have q/k norms, as each architecture's config says (or implies)."""

from __future__ import annotations

from typing import Any


def attention_fields(config: dict[str, Any], architecture: str) -> dict[str, Any]:
    """Qwen2 always has q/k/v biases (and none on o_proj); Llama's and Qwen3's attention_bias puts
    one on all four projections (transformers' LlamaAttention, Qwen3Attention). Qwen3 (and
    Qwen3-MoE) norm q and k per head."""
    bias = bool(config.get("attention_bias", False))
    return {"attention_bias": architecture == "qwen2" or bias,
            "attention_out_bias": architecture != "qwen2" and bias,
            "qk_norm": architecture in ("qwen3", "qwen3_moe")}


def hf_fields(config: dict[str, Any], architecture: str, folder) -> dict[str, Any]:
    return attention_fields(config, architecture)


def gguf_fields(meta: dict[str, Any], file, key, architecture: str) -> dict[str, Any]:
    """Nothing beyond the shared keys: biases and q/k norms are read off the file's tensors."""
    return {}

"""llama.cpp's `llama4` GGUF files (Llama 4 Scout / Maverick text) -> Llama 4's ModelArch
fields and tensor names.

llama.cpp's converter (Llama4Model) keeps the q/k rows as the checkpoint has them (interleaved
rotary pairs: the family's loader permutes them, as for the HF folder), splits the experts'
packed gate_up into `ffn_gate_exps` / `ffn_up_exps` [E, I, H] and stores `ffn_down_exps`
[E, H, I], nn.Linear rows; they are read under the stacked names
`feed_forward.experts.{gate,up,down}_proj`. The shared expert is `ffn_*_shexp`, the router
`ffn_gate_inp`, a dense layer's MLP `ffn_{gate,up,down}`; llama3 RoPE scaling is the
`rope_freqs` tensor (hearth/models/gguf_loader.py).

The file says less than config.json; what it leaves out is what llama.cpp assumes:

    attention.sliding_window          the chunk size; absent: 8192; 0: no chunked layers and
                                      RoPE on every layer (llama.cpp's all-full case)
    attention.sliding_window_pattern  which layers are chunked and RoPE'd (the others NoPE and
                                      full): n = every n-th layer is not (absent: 4), or a
                                      per-layer bool array
    attention.temperature_length      the NoPE layers' floor_scale (absent: 8192)
    attention.temperature_scale       their attn_scale (absent: 0.1); temperature tuning is on
    interleave_moe_layer_step         every step-th layer is MoE (required)

and the q/k RMS norm is used unless the file has 128 experts (Maverick), as llama.cpp decides.
"""

from __future__ import annotations

from typing import Any

from hearth.models.families.llama4.arch_fields import Llama4Spec
from hearth.models.specs import MoeSpec

_F = "feed_forward."
# GGUF block tensor ("name.kind" after "blk.{i}.") -> HF name after "model.layers.{i}."
TENSOR_NAMES = {
    **{f"ffn_{x}.weight": f"{_F}{x}_proj.weight" for x in ("gate", "up", "down")},
    **{f"ffn_{x}_exps.weight": f"{_F}experts.{x}_proj" for x in ("gate", "up", "down")},
    **{f"ffn_{x}_shexp.weight": f"{_F}shared_expert.{x}_proj.weight"
       for x in ("gate", "up", "down")},
    "ffn_gate_inp.weight": f"{_F}router.weight",
}
CHUNK_SIZE, PATTERN, FLOOR_SCALE, ATTN_SCALE = 8192, 4, 8192.0, 0.1  # llama.cpp's


def rope_layers(meta: dict[str, Any], prefix: str, num_layers: int, path) -> tuple[bool, ...]:
    """Which layers are chunked and RoPE'd (module docstring)."""
    pattern = meta.get(f"{prefix}.attention.sliding_window_pattern", PATTERN)
    if isinstance(pattern, (list, tuple)):
        if len(pattern) < num_layers:
            raise ValueError(f"{path}: {prefix}.attention.sliding_window_pattern has "
                             f"{len(pattern)} entries for {num_layers} layers")
        return tuple(bool(pattern[i]) for i in range(num_layers))
    every = int(pattern)
    if every < 1:
        raise ValueError(f"{path}: {prefix}.attention.sliding_window_pattern={every}")
    return tuple((i + 1) % every != 0 for i in range(num_layers))


def gguf_fields(meta: dict[str, Any], file, key, architecture: str) -> dict[str, Any]:
    prefix = meta["general.architecture"]
    num_layers, num_experts = int(key("block_count")), int(key("expert_count"))
    chunk = int(meta.get(f"{prefix}.attention.sliding_window", CHUNK_SIZE))
    rope = (rope_layers(meta, prefix, num_layers, file.path) if chunk
            else (True,) * num_layers)
    spec = Llama4Spec(
        rope_layers=rope, chunked_layers=rope if chunk else (False,) * num_layers,
        attention_chunk_size=chunk or None, qk_norm=num_experts != 128,
        temperature_tuning=True,
        floor_scale=float(meta.get(f"{prefix}.attention.temperature_length", FLOOR_SCALE)),
        attn_scale=float(meta.get(f"{prefix}.attention.temperature_scale", ATTN_SCALE)))
    step = int(key("interleave_moe_layer_step"))
    if step < 1:
        raise ValueError(f"{file.path}: {prefix}.interleave_moe_layer_step={step}")
    moe = MoeSpec(num_experts=num_experts,
                  num_experts_per_tok=int(key("expert_used_count")),
                  expert_intermediate_size=int(key("expert_feed_forward_length")),
                  norm_topk_prob=False, scoring_func="sigmoid",
                  dense_layers=tuple(i for i in range(num_layers) if (i + 1) % step),
                  num_shared_experts=1)
    return {"intermediate_size": int(key("feed_forward_length")), "moe": moe,
            "family_spec": spec}

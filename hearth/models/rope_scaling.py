"""`--rope-scaling`: a checkpoint's RoPE scaling replaced by one given on the command line.

The value is an HF `rope_scaling` object as JSON (what vLLM's `--hf-overrides` sets), e.g.
`{"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192}`. It replaces
the checkpoint's own `rope_scaling` whole, as vLLM's override does; the frequencies are then
computed exactly as for a config that carried it (hearth.models.layers._rope_inv_freq, tested
against transformers). MLA models (DeepSeek-V2/V3, Kimi K2) take it too: RoPE over their
`qk_rope_head_dim` rotary dims, and YaRN's `mscale_all_dim` also scaling the softmax
(hearth.models.families.deepseek.model.mla_softmax_scale), as transformers' DeepseekV3
computes them.

Replacing whole would silently drop what the checkpoint's own scaling says and the new type
computes with: its trained length where it is stretched past it (DeepSeek-V3: 4096 of 163840),
YaRN's ramp (Kimi K2: beta_fast 1, not the default 32), DeepSeek's `mscale` and
`mscale_all_dim`. An override that leaves out such a value, where leaving it out gives
something else, is refused naming the values to restate, rather than merged: the JSON means
here what it means to vLLM or transformers, and nothing the checkpoint said is lost unseen
(`dropped_values`).

Invariant: a scaled model's `max_position_embeddings` covers what the scaling is for. A
scaling stretches the positions the model was trained on, `original_max_position_embeddings`
(default: the checkpoint's `max_position_embeddings`, as transformers defaults it), by
`factor`; the arch's context becomes that product when it is longer than the checkpoint's own
(HF configs of scaled models say the same: YaRN's factor is max_position_embeddings /
original_max_position_embeddings), so the default model (8k) with factor 4 serves 32k tokens and
`--max-model-len` may ask for them. Parsing is torch-free: the CLI checks the value before any
process starts; what depends on the checkpoint is checked when it is opened.
"""

from __future__ import annotations

import json
from dataclasses import replace

from hearth.models.arch import ROPE_TYPES, ModelArch

SCALED_TYPES = tuple(t for t in ROPE_TYPES if t != "default")  # linear, llama3, yarn


def parse_rope_scaling(text: str) -> dict:
    """The JSON text of an HF rope_scaling object -> that dict with "rope_type" set (an old
    "type" key is read as it), or ValueError saying what is wrong."""
    try:
        scaling = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"rope_scaling: not JSON ({e.msg}): {text!r}") from None
    if not isinstance(scaling, dict):
        raise ValueError(f"rope_scaling: expected a JSON object such as "
                         f'\'{{"rope_type": "yarn", "factor": 4.0}}\', got {text!r}')
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type is None:
        raise ValueError(f"rope_scaling: 'rope_type' is missing (one of {', '.join(ROPE_TYPES)})")
    if rope_type == "dynamic":
        raise ValueError("rope_scaling: type 'dynamic' (dynamic NTK) is not supported: its RoPE "
                         "frequencies change with the sequence length, which a KV cache filled at "
                         "shorter lengths cannot follow; use 'yarn' or 'linear'")
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_scaling: unknown rope_type {rope_type!r}; hearth computes "
                         f"{', '.join(ROPE_TYPES)}")
    scaling = {**scaling, "rope_type": rope_type}
    scaling.pop("type", None)
    if rope_type == "default":  # no scaling: the checkpoint's plain RoPE
        return scaling
    for key, minimum in (("factor", 1.0), ("original_max_position_embeddings", 1),
                         ("low_freq_factor", 0.0), ("high_freq_factor", 0.0)):
        value = scaling.get(key)
        if value is None and key == "factor":
            raise ValueError(f"rope_scaling: {rope_type} needs a 'factor' (how many times the "
                             f"trained context it stretches RoPE to)")
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or value < minimum or (minimum == 0.0 and value == 0)):
            raise ValueError(f"rope_scaling: {key} must be a number "
                             f"{'>= ' + str(minimum) if minimum else '> 0'}, got {value!r}")
    if rope_type == "llama3" and (scaling.get("high_freq_factor", 4.0)
                                  <= scaling.get("low_freq_factor", 1.0)):
        raise ValueError("rope_scaling: llama3 needs high_freq_factor > low_freq_factor")
    return scaling


def scaled_context(arch: ModelArch, scaling: dict) -> int:
    """Positions a model of `arch` covers with `scaling`: the trained context times the factor,
    never fewer than the checkpoint's own."""
    if scaling["rope_type"] == "default":
        return arch.max_position_embeddings
    trained = int(scaling.get("original_max_position_embeddings", arch.max_position_embeddings))
    return max(arch.max_position_embeddings, int(trained * float(scaling["factor"])))


# What each scaled type computes with besides its factor and trained length, and what it gets
# where the JSON leaves a key out (None: nothing; hearth.models.layers._rope_inv_freq).
KEYS_READ = {
    "linear": {},
    "llama3": {"low_freq_factor": 1.0, "high_freq_factor": 4.0},
    "yarn": {"beta_fast": 32, "beta_slow": 1, "mscale": None, "mscale_all_dim": None,
             "attention_factor": None, "truncate": True},
}


def dropped_values(arch: ModelArch, scaling: dict) -> dict:
    """The values of the checkpoint's own rope_scaling that `scaling` computes with but leaves
    out, where leaving them out gives something else."""
    own, rope_type = arch.rope_scaling or {}, scaling["rope_type"]
    reads = dict(KEYS_READ.get(rope_type, {}))  # "default" reads nothing
    if rope_type in ("llama3", "yarn"):  # left out, the trained length is the checkpoint's
        reads = {"original_max_position_embeddings": arch.max_position_embeddings, **reads}
    if arch.mla is not None and rope_type != "default":
        reads.setdefault("mscale_all_dim", None)  # an MLA model's softmax, under any scaled type
    return {key: own[key] for key, default in reads.items()  # a falsy value reads as none
            if key in own and key not in scaling and (own[key] or None) != default}


def with_rope_scaling(arch: ModelArch, text: str | None) -> ModelArch:
    """`arch` with its rope_scaling replaced by the JSON `text` (None: `arch` unchanged) and its
    context stretched to match (`scaled_context`)."""
    if text is None:
        return arch
    scaling = parse_rope_scaling(text)
    dropped = dropped_values(arch, scaling)
    if dropped:
        raise ValueError(
            f"rope_scaling: the override replaces the checkpoint's own rope_scaling whole (as "
            f"vLLM's --hf-overrides does), so it would drop "
            f"{', '.join(f'{k}={v}' for k, v in dropped.items())}, which "
            f"{scaling['rope_type']} on this model computes with; restate them in the JSON (the "
            f"checkpoint's values, or the ones you mean)")
    if scaling["rope_type"] in ("llama3", "yarn"):  # what the ramp is measured against, explicit
        scaling.setdefault("original_max_position_embeddings", arch.max_position_embeddings)
    return replace(arch, rope_scaling=None if scaling["rope_type"] == "default" else scaling,
                   max_position_embeddings=scaled_context(arch, scaling))


def context_length(arch: ModelArch, max_model_len: int | None) -> int:
    """The engine's context: `max_model_len`, or all the (possibly scaled) model covers;
    ValueError when asked for more than the RoPE table was built for."""
    if max_model_len is None:
        return arch.max_position_embeddings
    if max_model_len < 1 or max_model_len > arch.max_position_embeddings:
        raise ValueError(f"max_model_len {max_model_len}: the model covers "
                         f"{arch.max_position_embeddings} positions; a longer context needs "
                         f"rope scaling (--rope-scaling '{{\"rope_type\": \"yarn\", \"factor\": "
                         f"{-(-max_model_len // arch.max_position_embeddings)}}}')")
    return max_model_len

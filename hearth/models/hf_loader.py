"""Hugging Face checkpoint folder (config.json + *.safetensors) -> ModelArch + tensors.

Invariant: tensors are read through safetensors' memory map only when asked for, in their stored
dtype (the caller casts), and a shard request reads only the shard's bytes (`get_slice`).
Sharded checkpoints are found through `model.safetensors.index.json`; without an index every
`*.safetensors` file in the folder is scanned.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from hearth.models.arch import ModelArch
from hearth.models.checkpoint import Checkpoint, Shard, TokenizerSource, shard_bounds
from hearth.models.registry import hf_family

_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)  # recomputed by the model; old checkpoints saved it
# DeepSeek-V3 / Kimi K2 release FP8 (e4m3) weights with one fp32 scale per 128 x 128 block in
# `<name>_scale_inv`; they are dequantized as read (value * scale) and the scales hidden.
FP8_SCALE_SUFFIX = "_scale_inv"
FP8_BLOCK = 128


class HFCheckpoint(Checkpoint):
    def __init__(self, folder: str | Path, name: str | None = None) -> None:
        self.folder = Path(folder)
        config = _read_json(self.folder / "config.json")
        self._files: dict[Path, Any] = {}  # open safe_open handles, one per file
        self._name_to_file = _index_tensors(self.folder)
        self._stored: dict[str, str] = {}  # name -> its name in the file, where they differ
        architectures = config.get("architectures") or [None]
        text_model = hf_family(architectures[0], self.folder)[0].hf_text_models.get(
            architectures[0])
        if text_model is not None:  # a multimodal checkpoint: its text model only
            config = text_model.text_config(config, self.folder)
            self._stored = text_model.text_tensors(list(self._name_to_file))
            self._name_to_file = {name: self._name_to_file[stored]
                                  for name, stored in self._stored.items()}
        self.arch = arch_from_hf_config(config, self.folder, has_lm_head="lm_head.weight" in self._name_to_file)
        self.name = name or self.folder.resolve().name
        self.tokenizer_source = TokenizerSource(folder=self.folder)

    def tensor_names(self) -> list[str]:
        return [n for n in self._name_to_file if not n.endswith(_IGNORED_SUFFIXES)
                and not (n.endswith(FP8_SCALE_SUFFIX)
                         and n.removesuffix(FP8_SCALE_SUFFIX) in self._name_to_file)]

    def _handle(self, name: str):
        path = self._name_to_file[name]
        if path not in self._files:
            self._files[path] = safe_open(path, framework="pt")
        return self._files[path]

    def get(self, name: str, shard: Shard | None = None) -> torch.Tensor:
        if name not in self._name_to_file:
            raise KeyError(f"{self.folder} has no tensor {name!r}")
        handle, stored = self._handle(name), self._stored.get(name, name)
        if name + FP8_SCALE_SUFFIX in self._name_to_file:
            scale = name + FP8_SCALE_SUFFIX
            value = _dequantize_fp8(handle.get_tensor(stored), self._handle(scale).get_tensor(
                self._stored.get(scale, scale)), name)
            if shard is None:
                return value
            dim = shard[0] % value.dim()
            start, stop = shard_bounds(value.shape[dim], shard, name)
            return value.narrow(dim, start, stop - start)
        if shard is None:
            return handle.get_tensor(stored)
        view = handle.get_slice(stored)
        shape = view.get_shape()
        dim = shard[0] % len(shape)
        start, stop = shard_bounds(shape[dim], shard, name)
        index = (slice(None),) * dim + (slice(start, stop),)
        return view[index]


def _dequantize_fp8(value: torch.Tensor, scale_inv: torch.Tensor, name: str) -> torch.Tensor:
    """[N, K] float8 weights times their [ceil(N/128), ceil(K/128)] block scales -> float32."""
    if value.dim() != 2 or scale_inv.dim() != 2:
        raise ValueError(f"{name}: FP8 block scales need a 2-D weight and scale, got "
                         f"{tuple(value.shape)} and {tuple(scale_inv.shape)}")
    rows, cols = value.shape
    want = (-(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK))
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"{name}{FP8_SCALE_SUFFIX}: shape {tuple(scale_inv.shape)}, expected "
                         f"{want} (one scale per {FP8_BLOCK} x {FP8_BLOCK} block)")
    scale = scale_inv.float().repeat_interleave(FP8_BLOCK, 0)[:rows].repeat_interleave(
        FP8_BLOCK, 1)[:, :cols]
    return value.float() * scale


def arch_from_hf_config(config: dict[str, Any], folder: Path, has_lm_head: bool = True) -> ModelArch:
    """The fields every family reads alike, then its family's own (`Family.hf_fields`: MoE and
    MLA specs, biases, q/k norms, head widths) over them."""
    architectures = config.get("architectures") or [None]
    family, architecture = hf_family(architectures[0], folder)
    max_positions = int(config["max_position_embeddings"])
    if not family.sliding_window:
        _reject_sliding_window(config, folder, max_positions)
    num_heads = int(config["num_attention_heads"])
    # transformers v5 moved rope_theta/rope_scaling into one rope_parameters dict
    rope = dict(config.get("rope_parameters") or {})
    rope_theta = float(config.get("rope_theta") or rope.pop("rope_theta", None) or 10000.0)
    rope.pop("rope_theta", None)
    rope_scaling = config.get("rope_scaling")
    if rope_scaling is None and rope.get("rope_type", "default") != "default":
        rope_scaling = rope
    if rope_scaling is not None and "rope_type" not in rope_scaling and "type" in rope_scaling:
        rope_scaling = {**rope_scaling, "rope_type": rope_scaling["type"]}
    if (rope_scaling is not None and rope_scaling.get("rope_type") == "yarn"
            and "original_max_position_embeddings" not in rope_scaling):
        # transformers' default: the config's own length is the pretrained one
        rope_scaling = {**rope_scaling, "original_max_position_embeddings": max_positions}
    fields = dict(
        architecture=architecture,
        vocab_size=int(config["vocab_size"]),
        hidden_size=int(config["hidden_size"]),
        intermediate_size=int(config["intermediate_size"]),
        num_layers=int(config["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
        head_dim=int(config.get("head_dim") or config["hidden_size"] // num_heads),
        max_position_embeddings=max_positions,
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)) or not has_lm_head,
        mlp_bias=bool(config.get("mlp_bias", False)),
        bos_token_id=config.get("bos_token_id"),
        eos_token_ids=_eos_token_ids(config, folder),
    )
    return ModelArch(**{**fields, **family.hf_fields(config, architecture, folder)})


def _reject_sliding_window(config: dict[str, Any], folder: Path, max_positions: int) -> None:
    """A family without windowed layers attends full causal; a window smaller than the context
    would change outputs."""
    window = config.get("sliding_window")
    if config.get("use_sliding_window") is False:  # Qwen2 carries a window it does not use
        return
    if window is not None and int(window) < max_positions:
        raise ValueError(
            f"{folder}: sliding_window={window} is smaller than max_position_embeddings="
            f"{max_positions}; sliding-window attention is not supported"
        )


def _eos_token_ids(config: dict[str, Any], folder: Path) -> tuple[int, ...]:
    ids: list[int] = []
    generation_config = folder / "generation_config.json"
    sources = [config] + ([_read_json(generation_config)] if generation_config.exists() else [])
    for source in sources:
        eos = source.get("eos_token_id")
        ids.extend([eos] if isinstance(eos, int) else eos or [])
    return tuple(dict.fromkeys(int(i) for i in ids))


def _index_tensors(folder: Path) -> dict[str, Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = _read_json(index)["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors files (hearth reads safetensors only)")
    name_to_file: dict[str, Path] = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            name_to_file.update((name, path) for name in f.keys())
    return name_to_file


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} not found") from None

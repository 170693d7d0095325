"""Model families: one folder each, listed in hearth/models/registry.py.

A family's folder holds everything hearth knows about it: the file formats' names it answers to
and how their configs become a `ModelArch` (`__init__.py`: its `FAMILY`), its modules
(`model.py`), how checkpoint tensors fill them (`loading.py`), and any format hooks of its own
(DeepSeek's `gguf.py`, `quant_hooks.py`). What several families share stays in hearth/models/ (layers,
the fused MoE, quantization and GGUF machinery, the loaders' common fields).

Importing a family's `__init__` reads no weights and imports no torch: a worker's HTTP process
resolves names without it. Its model, weight loader and quant hooks are named as
"module:attribute" inside the family's package and imported when a model is built.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable

# hf_fields(config.json dict, architecture, folder) -> ModelArch fields of this family
HfFields = Callable[[dict, str, Any], dict]
# gguf_fields(metadata, GGUFFile, key(suffix, default) -> value, architecture) -> ModelArch
# fields of this family (may include a refined "architecture", e.g. deepseek_v2 -> v3)
GgufFields = Callable[[dict, Any, Callable, str], dict]


@dataclass(frozen=True)
class TextModelIn:
    """Where a multimodal checkpoint keeps the text model a family serves (Llama 4's
    Llama4ForConditionalGeneration): its config.json under `config_key`, its tensors under
    `prefix` (read under their names without it); tensors under a `skipped` prefix (the vision
    tower) are never read. Any other tensor stays as named, so the load's check that every
    tensor found a place still refuses what the text model has no place for."""

    config_key: str = "text_config"
    prefix: str = "language_model."
    skipped: tuple[str, ...] = ()

    def text_config(self, config: dict, folder) -> dict:
        """The text model's config, named by the checkpoint's architectures."""
        inner = config.get(self.config_key)
        if not isinstance(inner, dict):
            raise ValueError(f"{folder}: config.json of a {config['architectures'][0]} has no "
                             f"{self.config_key!r}")
        return {**inner, "architectures": config["architectures"]}

    def text_tensors(self, stored: list[str]) -> dict[str, str]:
        """The text model's tensor name -> its name in the files, for each stored name."""
        out = {}
        for name in stored:
            if name.startswith(self.skipped):
                continue
            out[name.removeprefix(self.prefix)] = name
        return out


@dataclass(frozen=True, eq=False)
class Family:
    """One model family as the loaders, the model builder and the quantizer see it."""

    name: str  # its folder under hearth/models/families/
    architectures: tuple[str, ...]  # the ModelArch.architecture values it runs
    hf_names: dict[str, str]  # config.json "architectures"[0] -> ModelArch.architecture
    gguf_names: dict[str, str]  # GGUF general.architecture -> ModelArch.architecture
    hf_fields: HfFields  # config.json -> the ModelArch fields the shared parser does not know
    gguf_fields: GgufFields  # GGUF metadata -> the same
    model: str  # "module:class" in the family's package: the nn.Module that runs it
    load_weights: str = "loading:load_weights"  # "module:function(model, WeightLoader)"
    is_moe: bool = False  # every ModelArch of the family has a MoeSpec (and no other has)
    uses_mla: bool = False  # every ModelArch of the family has an MlaSpec (and no other has)
    # its hf_fields reads config.json's sliding_window and its attention applies it (gpt-oss);
    # every other family refuses a window shorter than the context (hf_loader)
    sliding_window: bool = False
    # GGUF names whose Q/K rows llama.cpp's converter permuted for interleaved RoPE
    gguf_permuted_qk: tuple[str, ...] = ()
    # GGUF block tensor names of this family beyond the Llama set -> HF names under a layer
    gguf_tensor_names: dict[str, str] = field(default_factory=dict)
    # "module" with the family's quantization hooks (attention_linears, quantize_attention);
    # None: the Llama attention layout (hearth/models/quant.py)
    quant: str | None = None
    # HF names (also in hf_names) of multimodal checkpoints whose text model this family serves
    hf_text_models: dict[str, TextModelIn] = field(default_factory=dict)

    def __post_init__(self) -> None:
        named = set(self.hf_names.values()) | set(self.gguf_names.values())
        if not named <= set(self.architectures):
            raise ValueError(f"family {self.name}: names map to {sorted(named)}, not all of "
                             f"its architectures {self.architectures}")

    def _resolve(self, ref: str) -> Any:
        module, attr = ref.split(":")
        return getattr(self._module(module), attr)

    def _module(self, module: str) -> ModuleType:
        return importlib.import_module(f"{__name__}.{self.name}.{module}")

    def model_class(self) -> type:
        return self._resolve(self.model)

    def weight_loader(self) -> Callable:
        return self._resolve(self.load_weights)

    def quant_hooks(self) -> ModuleType | None:
        return None if self.quant is None else self._module(self.quant)

"""One table of the model families hearth serves: file formats' architecture names -> family ->
model class.

Adding a family is a model module and a line in each table below: the HF `architectures[0]` of
its config.json, the GGUF `general.architecture` of its files (with whether llama.cpp's converter
permuted its Q/K rows for interleaved RoPE), and the class that runs it. Loaders ask this module
which family a file is; the model builder asks it for the class. Nothing else names families.
"""

from __future__ import annotations

import importlib

from hearth.models.arch import SUPPORTED_ARCHITECTURES

# config.json "architectures"[0] -> ModelArch.architecture
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}

# GGUF general.architecture -> (ModelArch.architecture, Q/K rows permuted by the converter).
# llama.cpp writes Mixtral as "llama" with stacked expert tensors (ffn_*_exps): the GGUF loader
# turns a "llama" file with experts into "mixtral". "deepseek2" holds DeepSeek-V2, V3 and Kimi
# K2: the loader makes a file with a sigmoid router "deepseek_v3" (its rotary rows are not
# permuted but left interleaved, as DeepSeek stores them; see gguf_loader).
GGUF_ARCHITECTURES = {
    "llama": ("llama", True),
    "mistral": ("mistral", True),
    "qwen2": ("qwen2", False),
    "qwen3": ("qwen3", False),
    "qwen3moe": ("qwen3_moe", False),
    "deepseek2": ("deepseek_v2", False),
}

# ModelArch.architecture -> "module:class" (imported when a model is built)
MODEL_CLASSES = {
    "llama": "hearth.models.families.llama.model:LlamaForCausalLM",
    "mistral": "hearth.models.families.llama.model:LlamaForCausalLM",
    "qwen2": "hearth.models.families.llama.model:LlamaForCausalLM",
    "qwen3": "hearth.models.families.llama.model:LlamaForCausalLM",
    "mixtral": "hearth.models.families.moe_llama.model:MoeLlamaForCausalLM",
    "qwen3_moe": "hearth.models.families.moe_llama.model:MoeLlamaForCausalLM",
    "deepseek_v2": "hearth.models.families.deepseek.model:DeepseekV3ForCausalLM",
    "deepseek_v3": "hearth.models.families.deepseek.model:DeepseekV3ForCausalLM",
}
assert set(MODEL_CLASSES) == set(SUPPORTED_ARCHITECTURES), "every family needs a model class"


def model_class(architecture: str) -> type:
    """The nn.Module class that runs `architecture` (a ModelArch.architecture)."""
    if architecture not in MODEL_CLASSES:
        raise ValueError(f"no model class for architecture {architecture!r}; hearth supports "
                         f"{', '.join(MODEL_CLASSES)}")
    module, name = MODEL_CLASSES[architecture].split(":")
    return getattr(importlib.import_module(module), name)

"""Mixtral and Qwen3-MoE: the Llama decoder with a sparse MoE block where the config says."""

from hearth.models.families import Family
from hearth.models.families.moe_llama import arch_fields

FAMILY = Family(
    name="moe_llama",
    architectures=("mixtral", "qwen3_moe"),
    hf_names={"MixtralForCausalLM": "mixtral", "Qwen3MoeForCausalLM": "qwen3_moe"},
    # llama.cpp writes Mixtral as "llama" with stacked expert tensors (ffn_*_exps): a "llama"
    # file with experts is this family's, one without the Llama family's (registry.gguf_family)
    gguf_names={"llama": "mixtral", "qwen3moe": "qwen3_moe"},
    gguf_permuted_qk=("llama",),
    hf_fields=arch_fields.hf_fields,
    gguf_fields=arch_fields.gguf_fields,
    model="model:MoeLlamaForCausalLM",
    is_moe=True,
)

"""The Llama family: Llama 2/3 (SmolLM2), Mistral, Qwen2/2.5 (QKV bias), Qwen3 (q/k norm)."""

from hearth.models.families import Family
from hearth.models.families.llama import arch_fields

FAMILY = Family(
    name="llama",
    architectures=("llama", "mistral", "qwen2", "qwen3"),
    hf_names={"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
              "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"},
    gguf_names={"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"},
    # llama.cpp's converter permutes Llama and Mistral Q/K rows for its interleaved RoPE;
    # Qwen files use NEOX-style RoPE and are stored as HF has them
    gguf_permuted_qk=("llama", "mistral"),
    hf_fields=arch_fields.hf_fields,
    gguf_fields=arch_fields.gguf_fields,
    model="model:LlamaForCausalLM",
)

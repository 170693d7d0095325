"""DeepSeek-V2/V3 and Kimi K2: the Llama decoder stack with multi-head latent attention (MLA)
and DeepSeek's MoE (grouped router, shared experts)."""

from hearth.models.families import Family
from hearth.models.families.deepseek import arch_fields, gguf

FAMILY = Family(
    name="deepseek",
    architectures=("deepseek_v2", "deepseek_v3"),
    hf_names={"DeepseekV2ForCausalLM": "deepseek_v2", "DeepseekV3ForCausalLM": "deepseek_v3"},
    # deepseek2 holds V2, V3 and Kimi K2: gguf.gguf_fields tells V3 by its sigmoid router
    gguf_names={"deepseek2": "deepseek_v2"},
    gguf_tensor_names=gguf.TENSOR_NAMES,
    hf_fields=arch_fields.hf_fields,
    gguf_fields=gguf.gguf_fields,
    model="model:DeepseekV3ForCausalLM",
    is_moe=True,
    uses_mla=True,
    quant="quant_hooks",
)

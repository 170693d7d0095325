"""Llama 4 (Scout, Maverick): the text model of Llama4ForConditionalGeneration checkpoints (the
vision tower skipped) and of Llama4ForCausalLM ones.

A Llama decoder with MoE layers (a sigmoid top-k router whose weight scales the expert's input,
plus a shared expert) interleaved with dense ones, chunked-local attention with RoPE on most
layers and full attention without RoPE (NoPE, with attention temperature tuning) on the rest.
"""

from hearth.models.families import Family, TextModelIn
from hearth.models.families.llama4 import arch_fields, gguf

FAMILY = Family(
    name="llama4",
    architectures=("llama4",),
    hf_names={"Llama4ForCausalLM": "llama4", "Llama4ForConditionalGeneration": "llama4"},
    hf_text_models={"Llama4ForConditionalGeneration": TextModelIn(
        config_key="text_config", prefix="language_model.",
        skipped=("vision_model.", "multi_modal_projector."))},
    gguf_names={"llama4": "llama4"},
    gguf_tensor_names=gguf.TENSOR_NAMES,
    hf_fields=arch_fields.hf_fields,
    gguf_fields=gguf.gguf_fields,
    model="model:Llama4ForCausalLM",
    is_moe=True,
    quant="quant_hooks",
)

"""gpt-oss (OpenAI's gpt-oss-20b / -120b): GptOssForCausalLM checkpoints.

A Llama-shaped decoder whose attention has q/k/v/o biases, a learned sink logit per head that
joins every softmax, and sliding-window (128-token) layers alternating with full ones; every
layer's MLP is a MoE of biased experts (a biased router, softmax over the top-k logits, a
clamped SwiGLU over interleaved gate/up columns). YaRN RoPE.
"""

from hearth.models.families import Family
from hearth.models.families.gpt_oss import arch_fields, gguf

FAMILY = Family(
    name="gpt_oss",
    architectures=("gpt_oss",),
    hf_names={"GptOssForCausalLM": "gpt_oss"},
    gguf_names={"gpt-oss": "gpt_oss"},
    gguf_tensor_names=gguf.TENSOR_NAMES,
    hf_fields=arch_fields.hf_fields,
    gguf_fields=gguf.gguf_fields,
    model="model:GptOssForCausalLM",
    is_moe=True,
    sliding_window=True,
)

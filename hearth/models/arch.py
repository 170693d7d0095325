"""The shape of a model, whatever file it came from.

Every loader (HF folder, GGUF) produces one `ModelArch` plus a name -> tensor mapping in Hugging
Face naming (`model.layers.{i}.self_attn.q_proj.weight`, ...), with Q/K weights in HF's
rotate-half RoPE layout. The model code only ever sees this. `architecture` names the family
(hearth/models/registry.py maps file formats' names to it and it to a model class); a
Mixture-of-Experts model also carries a `MoeSpec`.
"""

from __future__ import annotations

from dataclasses import dataclass, field


SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe")
MOE_ARCHITECTURES = ("mixtral", "qwen3_moe")
# rope_scaling types computed as transformers does (hearth.models.layers._rope_inv_freq).
# "dynamic" (dynamic NTK) is refused: its frequencies depend on the current sequence length,
# so keys cached at one length would be rotated differently from queries at another.
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class MoeSpec:
    """The sparse MLP of a Mixture-of-Experts model (Mixtral, Qwen3-MoE): a softmax router picks
    `num_experts_per_tok` of `num_experts` SiLU-gated experts per token."""

    num_experts: int
    num_experts_per_tok: int
    expert_intermediate_size: int  # each expert's gate/up width (Qwen3 moe_intermediate_size)
    # top-k weights renormalised to sum to 1 (Mixtral always; Qwen3-MoE's norm_topk_prob)
    norm_topk_prob: bool = True
    dense_layers: tuple[int, ...] = ()  # layers with a dense MLP (Qwen3 mlp_only_layers, ...)

    def __post_init__(self) -> None:
        if self.num_experts < 1 or not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"MoE: num_experts_per_tok={self.num_experts_per_tok} must be in "
                             f"1..num_experts={self.num_experts}")
        if self.expert_intermediate_size < 1:
            raise ValueError(f"MoE: expert intermediate size {self.expert_intermediate_size}")


@dataclass(frozen=True)
class ModelArch:
    architecture: str  # one of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # HF-style rope_scaling dict ({"rope_type": one of ROPE_TYPES, "factor": ..., ...}) or None
    rope_scaling: dict | None = field(default=None, hash=False, compare=False)
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2; Llama/Qwen3 attention_bias)
    attention_out_bias: bool = False  # bias on o_proj (Llama/Qwen3 attention_bias; never Qwen2)
    mlp_bias: bool = False  # bias on gate/up/down projections (Llama mlp_bias)
    qk_norm: bool = False  # Qwen3: RMSNorm on q and k per head
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    moe: MoeSpec | None = None  # set exactly for the MOE_ARCHITECTURES

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and layer not in self.moe.dense_layers

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; "
                f"hearth supports {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if (self.moe is not None) != (self.architecture in MOE_ARCHITECTURES):
            raise ValueError(f"architecture {self.architecture!r} "
                             f"{'needs' if self.moe is None else 'takes no'} MoE settings")
        scaling = self.rope_scaling or {}
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type == "dynamic":
            raise ValueError(
                "rope_scaling type 'dynamic' (dynamic NTK) is not supported: its RoPE frequencies "
                "change with the sequence length, which a KV cache filled at shorter lengths cannot "
                "follow. Remove rope_scaling to run within max_position_embeddings "
                f"({self.max_position_embeddings}) unscaled, or use a 'yarn' or 'linear' config")
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"unsupported rope_scaling type {rope_type!r}; hearth supports "
                             f"{', '.join(ROPE_TYPES)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )

"""The shape of a model, whatever file it came from.

Every loader (HF folder, GGUF) produces one `ModelArch` plus a name -> tensor mapping in Hugging
Face naming (`model.layers.{i}.self_attn.q_proj.weight`, ...), with Q/K weights in HF's
rotate-half RoPE layout. The model code only ever sees this. `architecture` names the model
within its family (hearth/models/registry.py maps file formats' names to it and it to the
family's code); a Mixture-of-Experts family's arch also carries a `MoeSpec`, a multi-head
latent attention family's (DeepSeek-V2/V3, Kimi K2) an `MlaSpec`.

The KV cache of every family is one tensor `[num_layers, planes, num_blocks, block_size, heads,
dim]` (`ModelArch.kv_cache_layout`): K and V planes of `num_kv_heads` heads for multi-head
attention, one plane of one "head" per token for MLA (the normed latent and the roped shared
key, `kv_lora_rank + qk_rope_head_dim` values).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hearth.models.specs import SCORING_FUNCS, TOPK_METHODS, MlaSpec, MoeSpec  # noqa: F401  (re-exported)


# rope_scaling types computed as transformers does (hearth.models.layers._rope_inv_freq).
# "dynamic" (dynamic NTK) is refused: its frequencies depend on the current sequence length,
# so keys cached at one length would be rotated differently from queries at another.
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class ModelArch:
    architecture: str  # one of registry.SUPPORTED_ARCHITECTURES
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
    moe: MoeSpec | None = None  # set exactly for a MoE family's (Family.is_moe)
    mla: MlaSpec | None = None  # set exactly for an MLA family's (head_dim: its qk width)
    # A family's own settings beyond these fields: a frozen (hashable) object its folder defines
    # and only its code reads (Llama 4's per-layer RoPE / NoPE, chunked attention, temperature).
    # It may refuse a KV cache block size its attention cannot serve (`check_block_size`).
    family_spec: object | None = None

    def check_block_size(self, block_size: int) -> None:
        """Raise a ValueError if the model's attention cannot run over cache blocks of
        `block_size` tokens (a family spec's `check_block_size`; every other model can)."""
        check = getattr(self.family_spec, "check_block_size", None)
        if check is not None:
            check(block_size)

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and layer not in self.moe.dense_layers

    @property
    def rotary_dim(self) -> int:
        """Width of the rotated part of a query/key head (all of it but for MLA)."""
        return self.head_dim if self.mla is None else self.mla.qk_rope_head_dim

    def kv_cache_layout(self, tp_size: int = 1) -> tuple[int, int, int]:
        """(planes, heads, dim) of one token's KV in one layer on one tensor-parallel rank: K
        and V of the rank's KV heads (sharded when there are enough, else replicated), or
        MLA's one latent row, replicated on every rank."""
        if self.mla is not None:
            return 1, 1, self.mla.latent_dim
        return 2, max(1, self.num_kv_heads // tp_size), self.head_dim

    def __post_init__(self) -> None:
        from hearth.models.registry import family_of  # imports the families, which import specs only

        family = family_of(self.architecture)
        if (self.mla is not None) != family.uses_mla:
            raise ValueError(f"architecture {self.architecture!r} "
                             f"{'needs' if self.mla is None else 'takes no'} MLA settings")
        if (self.moe is not None) != family.is_moe:
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

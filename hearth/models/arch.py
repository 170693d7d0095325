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


# DeepSeek routers: how expert scores are made and how the top k are picked among groups.
SCORING_FUNCS = ("softmax", "sigmoid")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
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
    # DeepSeek's router (defaults: the softmax top-k router above). Scores by `scoring_func`;
    # `topk_method` "noaux_tc" picks among score + e_score_correction_bias, "group_limited_greedy"
    # among the raw scores, both only inside the `topk_group` best of `n_group` expert groups;
    # the weights are the scores (renormalised with norm_topk_prob) times routed_scaling_factor.
    scoring_func: str = "softmax"
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    # DeepSeek's shared experts: one dense SiLU MLP of n_shared_experts * expert width, added to
    # the routed experts' output in every sparse layer (0: none)
    num_shared_experts: int = 0

    def __post_init__(self) -> None:
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(f"MoE: unsupported scoring_func {self.scoring_func!r} "
                             f"({', '.join(SCORING_FUNCS)})")
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"MoE: unsupported topk_method {self.topk_method!r} "
                             f"({', '.join(TOPK_METHODS)})")
        if (self.n_group < 1 or self.num_experts % self.n_group
                or not 1 <= self.topk_group <= self.n_group):
            raise ValueError(f"MoE: n_group={self.n_group} must divide num_experts="
                             f"{self.num_experts} and topk_group={self.topk_group} be in "
                             f"1..n_group")
        if self.num_experts < 1 or not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"MoE: num_experts_per_tok={self.num_experts_per_tok} must be in "
                             f"1..num_experts={self.num_experts}")
        if self.expert_intermediate_size < 1:
            raise ValueError(f"MoE: expert intermediate size {self.expert_intermediate_size}")


@dataclass(frozen=True)
class MlaSpec:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi K2). Per token, K and V of every head
    come from one latent `c = norm(x W_dkv)` of `kv_lora_rank` values through `kv_b_proj`
    (k_nope and v per head), plus one roped key of `qk_rope_head_dim` shared by all heads; the
    query of each head is `qk_nope_head_dim + qk_rope_head_dim` wide (through a `q_lora_rank`
    bottleneck, or one q_proj when it is None). The cache keeps only c and the roped key."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    # The checkpoint stores each rotary slice in interleaved pairs (2j, 2j+1) (DeepSeek's
    # layout; transformers' rope_interleave): the loader permutes those rows to rotate-half.
    rope_interleave: bool = True

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values per token per layer in the cache."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def __post_init__(self) -> None:
        dims = (self.kv_lora_rank, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim)
        if min(dims) < 1 or self.qk_rope_head_dim % 2 or (self.q_lora_rank or 1) < 1:
            raise ValueError(f"MLA: bad dimensions kv_lora_rank, qk_nope_head_dim, "
                             f"qk_rope_head_dim (even), v_head_dim = {dims}, "
                             f"q_lora_rank={self.q_lora_rank}")


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
        from hearth.models.registry import family_of  # the registry's families import this module

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

"""The settings of a model's optional parts: a Mixture-of-Experts MLP (`MoeSpec`) and multi-head
latent attention (`MlaSpec`). A `hearth.models.arch.ModelArch` carries them; family folders'
config parsers build them. They live apart from `arch` because the registry's families import
them while `ModelArch` asks the registry which family it belongs to.
"""

from __future__ import annotations

from dataclasses import dataclass


# DeepSeek routers: how expert scores are made and how the top k are picked among groups.
SCORING_FUNCS = ("softmax", "sigmoid")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


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

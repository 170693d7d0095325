"""Write a random-weight Llama-family checkpoint as a HF folder (config.json, model.safetensors,
tokenizer.json) of any shape: dense Llama, or with `num_experts` a Mixture-of-Experts model
(Qwen3-MoE, or Mixtral with `architecture="mixtral"`) in transformers' per-expert layout.

For tests, benchmarks and GPU checks that need a model of a given shape without downloading one;
being a folder on disk, every rank process can open it by path like a real checkpoint. Weights are
scaled so activations stay O(1) through many layers, which keeps greedy decoding from collapsing
into ties (ties would make parity tests meaningless).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def random_llama_weights(num_layers: int, hidden_size: int, num_heads: int, num_kv_heads: int,
                         intermediate_size: int, vocab_size: int, head_dim: int | None = None,
                         tie_word_embeddings: bool = False, seed: int = 0,
                         num_experts: int = 0, expert_intermediate_size: int = 0,
                         qk_norm: bool = False, mixtral: bool = False,
                         dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    head_dim = head_dim or hidden_size // num_heads

    def linear(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=gen) / cols ** 0.5).to(dtype)

    def norm(dim: int) -> torch.Tensor:
        return (1.0 + 0.1 * torch.randn(dim, generator=gen)).to(dtype)

    w = {"model.embed_tokens.weight": torch.randn(vocab_size, hidden_size, generator=gen).to(dtype),
         "model.norm.weight": norm(hidden_size)}
    if not tie_word_embeddings:
        w["lm_head.weight"] = linear(vocab_size, hidden_size)
    for i in range(num_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(hidden_size)
        w[p + "post_attention_layernorm.weight"] = norm(hidden_size)
        w[p + "self_attn.q_proj.weight"] = linear(num_heads * head_dim, hidden_size)
        w[p + "self_attn.k_proj.weight"] = linear(num_kv_heads * head_dim, hidden_size)
        w[p + "self_attn.v_proj.weight"] = linear(num_kv_heads * head_dim, hidden_size)
        w[p + "self_attn.o_proj.weight"] = linear(hidden_size, num_heads * head_dim)
        if qk_norm:
            w[p + "self_attn.q_norm.weight"] = norm(head_dim)
            w[p + "self_attn.k_norm.weight"] = norm(head_dim)
        if num_experts:
            moe = p + ("block_sparse_moe." if mixtral else "mlp.")
            w[moe + "gate.weight"] = linear(num_experts, hidden_size)
            names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
            for j in range(num_experts):
                e = moe + f"experts.{j}."
                w[e + names[0] + ".weight"] = linear(expert_intermediate_size, hidden_size)
                w[e + names[1] + ".weight"] = linear(expert_intermediate_size, hidden_size)
                w[e + names[2] + ".weight"] = linear(hidden_size, expert_intermediate_size)
            continue
        w[p + "mlp.gate_proj.weight"] = linear(intermediate_size, hidden_size)
        w[p + "mlp.up_proj.weight"] = linear(intermediate_size, hidden_size)
        w[p + "mlp.down_proj.weight"] = linear(hidden_size, intermediate_size)
    return w


def write_random_checkpoint(folder: str | Path, num_layers: int = 4, hidden_size: int = 64,
                            num_heads: int = 4, num_kv_heads: int = 2,
                            intermediate_size: int = 128, vocab_size: int = 256,
                            max_position_embeddings: int = 1024, tie_word_embeddings: bool = False,
                            seed: int = 0, num_experts: int = 0, num_experts_per_tok: int = 2,
                            expert_intermediate_size: int = 64, architecture: str = "qwen3_moe",
                            head_dim: int | None = None,
                            dtype: torch.dtype = torch.float32) -> Path:
    """`num_experts` > 0: a MoE model (`architecture` "qwen3_moe" or "mixtral"), every layer
    sparse, top-`num_experts_per_tok` renormalised."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    hf_arch, extra = "LlamaForCausalLM", {"model_type": "llama"}
    if num_experts and architecture == "mixtral":
        hf_arch, intermediate_size = "MixtralForCausalLM", expert_intermediate_size
        extra = {"model_type": "mixtral", "num_local_experts": num_experts,
                 "num_experts_per_tok": num_experts_per_tok}
    elif num_experts:
        hf_arch = "Qwen3MoeForCausalLM"
        extra = {"model_type": "qwen3_moe", "num_experts": num_experts, "num_experts_per_tok": num_experts_per_tok,
                 "moe_intermediate_size": expert_intermediate_size, "norm_topk_prob": True,
                 "decoder_sparse_step": 1, "mlp_only_layers": [],
                 "head_dim": head_dim or hidden_size // num_heads}
    config = {
        **extra, "architectures": [hf_arch], "vocab_size": vocab_size,
        "hidden_size": hidden_size, "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers, "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads, "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": tie_word_embeddings,
        "bos_token_id": 1, "eos_token_id": 2,
    }
    (folder / "config.json").write_text(json.dumps(config))
    weights = random_llama_weights(num_layers, hidden_size, num_heads, num_kv_heads,
                                   intermediate_size, vocab_size, head_dim=head_dim,
                                   tie_word_embeddings=tie_word_embeddings, seed=seed,
                                   num_experts=num_experts,
                                   expert_intermediate_size=expert_intermediate_size,
                                   qk_norm=hf_arch == "Qwen3MoeForCausalLM",
                                   mixtral=hf_arch == "MixtralForCausalLM", dtype=dtype)
    save_file(weights, str(folder / "model.safetensors"))
    _write_word_tokenizer(folder / "tokenizer.json", vocab_size)
    return folder


def _write_word_tokenizer(path: Path, vocab_size: int) -> None:
    """One word per token ("t0", "t1", ...), split on whitespace: enough to encode and decode."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(str(path))


def write_random_deepseek(folder: str | Path, num_layers: int = 3, hidden_size: int = 64,
                          num_heads: int = 4, q_lora_rank: int | None = 32,
                          kv_lora_rank: int = 32, qk_nope_head_dim: int = 16,
                          qk_rope_head_dim: int = 8, v_head_dim: int = 16,
                          intermediate_size: int = 128, num_experts: int = 8,
                          num_experts_per_tok: int = 2, expert_intermediate_size: int = 32,
                          n_group: int = 4, topk_group: int = 2, n_shared_experts: int = 1,
                          first_k_dense_replace: int = 1, routed_scaling_factor: float = 2.5,
                          vocab_size: int = 256, max_position_embeddings: int = 1024,
                          rope_scaling: dict | None = None, architecture: str = "deepseek_v3",
                          seed: int = 0, dtype: torch.dtype = torch.float32) -> Path:
    """A random DeepSeek-V3 (or, with `architecture="deepseek_v2"`, V2: softmax router,
    group-limited, no correction bias) checkpoint in DeepSeek's own layout: per-expert
    tensors, the router's fp32 `e_score_correction_bias`, shared experts, interleaved rotary
    rows (random weights: any layout reads the same). Kimi K2 is this shape at scale."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    v3 = architecture == "deepseek_v3"
    gen = torch.Generator().manual_seed(seed)

    def linear(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=gen) / cols ** 0.5).to(dtype)

    def norm(dim: int) -> torch.Tensor:
        return (1.0 + 0.1 * torch.randn(dim, generator=gen)).to(dtype)

    qk = qk_nope_head_dim + qk_rope_head_dim
    w = {"model.embed_tokens.weight": torch.randn(vocab_size, hidden_size, generator=gen).to(dtype),
         "model.norm.weight": norm(hidden_size), "lm_head.weight": linear(vocab_size, hidden_size)}
    for i in range(num_layers):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        w[p + "input_layernorm.weight"] = norm(hidden_size)
        w[p + "post_attention_layernorm.weight"] = norm(hidden_size)
        if q_lora_rank:
            w[a + "q_a_proj.weight"] = linear(q_lora_rank, hidden_size)
            w[a + "q_a_layernorm.weight"] = norm(q_lora_rank)
            w[a + "q_b_proj.weight"] = linear(num_heads * qk, q_lora_rank)
        else:
            w[a + "q_proj.weight"] = linear(num_heads * qk, hidden_size)
        w[a + "kv_a_proj_with_mqa.weight"] = linear(kv_lora_rank + qk_rope_head_dim, hidden_size)
        w[a + "kv_a_layernorm.weight"] = norm(kv_lora_rank)
        w[a + "kv_b_proj.weight"] = linear(num_heads * (qk_nope_head_dim + v_head_dim),
                                           kv_lora_rank)
        w[a + "o_proj.weight"] = linear(hidden_size, num_heads * v_head_dim)
        mlps = {"mlp.": intermediate_size}
        if i >= first_k_dense_replace:
            w[p + "mlp.gate.weight"] = linear(num_experts, hidden_size).float()
            if v3:  # small, so it reorders some picks without swamping the scores
                w[p + "mlp.gate.e_score_correction_bias"] = 0.05 * torch.randn(num_experts,
                                                                               generator=gen)
            mlps = {f"mlp.experts.{j}.": expert_intermediate_size for j in range(num_experts)}
            if n_shared_experts:
                mlps["mlp.shared_experts."] = n_shared_experts * expert_intermediate_size
        for m, width in mlps.items():
            w[p + m + "gate_proj.weight"] = linear(width, hidden_size)
            w[p + m + "up_proj.weight"] = linear(width, hidden_size)
            w[p + m + "down_proj.weight"] = linear(hidden_size, width)
    config = {
        "architectures": ["DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"],
        "model_type": architecture, "vocab_size": vocab_size, "hidden_size": hidden_size,
        "intermediate_size": intermediate_size, "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads, "num_key_value_heads": num_heads,
        "q_lora_rank": q_lora_rank, "kv_lora_rank": kv_lora_rank,
        "qk_nope_head_dim": qk_nope_head_dim, "qk_rope_head_dim": qk_rope_head_dim,
        "v_head_dim": v_head_dim, "n_routed_experts": num_experts,
        "n_shared_experts": n_shared_experts, "num_experts_per_tok": num_experts_per_tok,
        "moe_intermediate_size": expert_intermediate_size, "moe_layer_freq": 1,
        "first_k_dense_replace": first_k_dense_replace, "n_group": n_group,
        "topk_group": topk_group, "routed_scaling_factor": routed_scaling_factor,
        "norm_topk_prob": v3, "scoring_func": "sigmoid" if v3 else "softmax",
        "topk_method": "noaux_tc" if v3 else "group_limited_greedy",
        "max_position_embeddings": max_position_embeddings, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "rope_scaling": rope_scaling, "tie_word_embeddings": False,
        "attention_bias": False, "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2,
    }
    (folder / "config.json").write_text(json.dumps(config))
    save_file(w, str(folder / "model.safetensors"))
    _write_word_tokenizer(folder / "tokenizer.json", vocab_size)
    return folder

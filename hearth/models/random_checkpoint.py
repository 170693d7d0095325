"""Write a random-weight Llama checkpoint as a HF folder (config.json, model.safetensors,
tokenizer.json) of any shape.

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
                         tie_word_embeddings: bool = False,
                         seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    head_dim = head_dim or hidden_size // num_heads

    def linear(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen) / cols ** 0.5

    def norm(dim: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(dim, generator=gen)

    w = {"model.embed_tokens.weight": torch.randn(vocab_size, hidden_size, generator=gen),
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
        w[p + "mlp.gate_proj.weight"] = linear(intermediate_size, hidden_size)
        w[p + "mlp.up_proj.weight"] = linear(intermediate_size, hidden_size)
        w[p + "mlp.down_proj.weight"] = linear(hidden_size, intermediate_size)
    return w


def write_random_checkpoint(folder: str | Path, num_layers: int = 4, hidden_size: int = 64,
                            num_heads: int = 4, num_kv_heads: int = 2,
                            intermediate_size: int = 128, vocab_size: int = 256,
                            max_position_embeddings: int = 1024, tie_word_embeddings: bool = False,
                            seed: int = 0) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"], "vocab_size": vocab_size,
        "hidden_size": hidden_size, "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers, "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads, "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": tie_word_embeddings,
        "bos_token_id": 1, "eos_token_id": 2,
    }
    (folder / "config.json").write_text(json.dumps(config))
    weights = random_llama_weights(num_layers, hidden_size, num_heads, num_kv_heads,
                                   intermediate_size, vocab_size,
                                   tie_word_embeddings=tie_word_embeddings, seed=seed)
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

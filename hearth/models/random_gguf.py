"""Write a random-weight Llama GGUF in K-quant blocks, streamed to disk block by block.

For the real-size benchmarks (an 8B-shaped Q4_K_M file is 4.6 GB: no float model of it ever
exists, here or in the loader) and for tests of the K-quant paths on tiny shapes. The default
model's tokenizer (its GGUF's `tokenizer.*` keys) stands in, so the vocabulary is its 49,152
tokens.

Block mixes:
  q4_k_m   llama.cpp's Q4_K_M recipe: every 2-D weight Q4_K, except output.weight and, in the
           first and last eighth of the layers and every third between, attn_v and ffn_down,
           which are Q6_K
  q4_k     every 2-D weight Q4_K
A Qwen3-MoE shape (`qwen3moe`) stacks each layer's experts (ffn_*_exps, the dense weights'
types) behind an F32 router. Norms are F32 ones. Scales are drawn so a weight's spread is ~1/sqrt(fan-in) (activations stay
O(1) through the layers; random bytes in the fp16 fields would make inf/NaN weights).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

Q4_K, Q6_K, F32 = 12, 14, 0
MIXES = ("q4_k_m", "q4_k")


@dataclass(frozen=True)
class LlamaShape:
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    # Qwen3-MoE (`qwen3moe`, with q/k norms) when num_experts > 0: every layer's MLP is
    # num_experts experts of expert_intermediate_size, experts_per_tok routed per token
    num_experts: int = 0
    experts_per_tok: int = 0
    expert_intermediate_size: int = 0

    @property
    def architecture(self) -> str:
        return "qwen3moe" if self.num_experts else "llama"


# Llama-3.1-8B, Qwen3-30B-A3B, and Llama-3.2-1B (a quick check of the whole pipeline)
SHAPES = {
    "llama8b": LlamaShape(32, 4096, 14336, 32, 8, 128),
    "qwen3-30b-a3b": LlamaShape(48, 2048, 6144, 32, 4, 128, num_experts=128, experts_per_tok=8,
                                expert_intermediate_size=768),
    "llama1b": LlamaShape(16, 2048, 8192, 32, 8, 64),
}


def more_bits(layer: int, num_layers: int) -> bool:
    """llama.cpp's use_more_bits: the layers whose attn_v / ffn_down Q4_K_M keeps in Q6_K."""
    eighth = num_layers // 8
    return layer < eighth or layer >= 7 * eighth or (layer - eighth) % 3 == 2


def q4_k_blocks(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """[rows, cols / 256 * 144] uint8 Q4_K super-blocks: w = d sc q - dmin mn per 32-block.
    dmin ~ 7.5 d centres the weights (mean q 7.5); their spread is ~300 d."""
    ns = rows * cols // 256
    out = rng.integers(0, 256, size=(ns, 144), dtype=np.uint8)
    d = (rng.uniform(0.5, 1.5, size=ns) / (300 * cols ** 0.5)).astype(np.float16)
    dmin = (d.astype(np.float32) * rng.uniform(6.5, 8.5, size=ns)).astype(np.float16)
    out[:, 0:2] = d.view(np.uint8).reshape(ns, 2)
    out[:, 2:4] = dmin.view(np.uint8).reshape(ns, 2)
    return out.reshape(rows, -1)


def q6_k_blocks(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """[rows, cols / 256 * 210] uint8 Q6_K super-blocks (ql | qh | 16 int8 scales | d fp16):
    w = d sc (q - 32), spread ~680 d."""
    ns = rows * cols // 256
    out = rng.integers(0, 256, size=(ns, 210), dtype=np.uint8)
    out[:, 192:208] = rng.integers(1, 64, size=(ns, 16), dtype=np.int8).view(np.uint8)
    d = (rng.uniform(0.5, 1.5, size=ns) / (680 * cols ** 0.5)).astype(np.float16)
    out[:, 208:210] = d.view(np.uint8).reshape(ns, 2)
    return out.reshape(rows, -1)


def tensor_plan(shape: LlamaShape, vocab_size: int, mix: str) -> list[tuple[str, tuple, int]]:
    """(GGUF name, shape in torch order, ggml type) of every tensor, in file order."""
    if mix not in MIXES:
        raise ValueError(f"mix: {mix!r} is not one of {', '.join(MIXES)}")
    s = shape
    q_rows, kv_rows = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    plan: list[tuple[str, tuple, int]] = [("token_embd.weight", (vocab_size, s.hidden_size), Q4_K)]
    for i in range(s.num_layers):
        k6 = Q6_K if mix == "q4_k_m" and more_bits(i, s.num_layers) else Q4_K
        plan += [(f"blk.{i}.attn_norm.weight", (s.hidden_size,), F32),
                 (f"blk.{i}.attn_q.weight", (q_rows, s.hidden_size), Q4_K),
                 (f"blk.{i}.attn_k.weight", (kv_rows, s.hidden_size), Q4_K),
                 (f"blk.{i}.attn_v.weight", (kv_rows, s.hidden_size), k6),
                 (f"blk.{i}.attn_output.weight", (s.hidden_size, q_rows), Q4_K),
                 (f"blk.{i}.ffn_norm.weight", (s.hidden_size,), F32)]
        if s.num_experts:
            e, width = s.num_experts, s.expert_intermediate_size
            plan += [(f"blk.{i}.attn_q_norm.weight", (s.head_dim,), F32),
                     (f"blk.{i}.attn_k_norm.weight", (s.head_dim,), F32),
                     (f"blk.{i}.ffn_gate_inp.weight", (e, s.hidden_size), F32),
                     (f"blk.{i}.ffn_gate_exps.weight", (e, width, s.hidden_size), Q4_K),
                     (f"blk.{i}.ffn_up_exps.weight", (e, width, s.hidden_size), Q4_K),
                     (f"blk.{i}.ffn_down_exps.weight", (e, s.hidden_size, width), k6)]
            continue
        plan += [(f"blk.{i}.ffn_gate.weight", (s.intermediate_size, s.hidden_size), Q4_K),
                 (f"blk.{i}.ffn_up.weight", (s.intermediate_size, s.hidden_size), Q4_K),
                 (f"blk.{i}.ffn_down.weight", (s.hidden_size, s.intermediate_size), k6)]
    out_type = Q6_K if mix == "q4_k_m" else Q4_K
    return plan + [("output_norm.weight", (s.hidden_size,), F32),
                   ("output.weight", (vocab_size, s.hidden_size), out_type)]


def write_random_gguf(out: Path, shape: LlamaShape, tokenizer_gguf: str | Path,
                      mix: str = "q4_k_m", seed: int = 0, context_length: int = 131072) -> Path:
    """Write the file: header and tensor table first, then each tensor's blocks as drawn (one
    tensor's bytes in memory at a time)."""
    import gguf

    from hearth.models.gguf_file import GGUFFile

    source = GGUFFile(tokenizer_gguf)
    vocab_size = source.tensors["token_embd.weight"].shape[0]
    plan = tensor_plan(shape, vocab_size, mix)
    arch = shape.architecture
    writer = gguf.GGUFWriter(str(out), arch)
    keys = [("block_count", shape.num_layers), ("context_length", context_length),
            ("embedding_length", shape.hidden_size),
            ("feed_forward_length", shape.intermediate_size),
            ("attention.head_count", shape.num_heads),
            ("attention.head_count_kv", shape.num_kv_heads),
            ("attention.key_length", shape.head_dim),
            ("attention.value_length", shape.head_dim), ("rope.dimension_count", shape.head_dim)]
    if shape.num_experts:
        keys += [("expert_count", shape.num_experts), ("expert_used_count", shape.experts_per_tok),
                 ("expert_feed_forward_length", shape.expert_intermediate_size)]
    for key, value in keys:
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_float32(f"{arch}.rope.freq_base", 500000.0)
    _copy_tokenizer(source.metadata, writer)
    for name, tshape, qtype in plan:
        if qtype == F32:
            writer.add_tensor_info(name, tshape, np.dtype(np.float32), 4 * int(np.prod(tshape)))
            continue
        if tshape[-1] % 256:
            raise ValueError(f"{name}: K-quant rows need a multiple of 256 columns, got {tshape}")
        row_bytes = tshape[-1] // 256 * (144 if qtype == Q4_K else 210)
        rows = int(np.prod(tshape[:-1]))
        writer.add_tensor_info(name, (*tshape[:-1], row_bytes), np.dtype(np.uint8),
                               rows * row_bytes, raw_dtype=gguf.GGMLQuantizationType(qtype))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, tshape, qtype in plan:
        if qtype != F32:
            rows = int(np.prod(tshape[:-1]))
            blocks = (q4_k_blocks if qtype == Q4_K else q6_k_blocks)(rng, rows, tshape[-1])
            writer.write_tensor_data(blocks.reshape(*tshape[:-1], -1))
        elif name.endswith("ffn_gate_inp.weight"):  # a router that spreads tokens over experts
            writer.write_tensor_data(rng.standard_normal(tshape, dtype=np.float32)
                                     / tshape[1] ** 0.5)
        else:
            writer.write_tensor_data(np.ones(tshape, dtype=np.float32))
    writer.close()
    return out


def _copy_tokenizer(metadata: dict, writer) -> None:
    """The `tokenizer.*` keys of another GGUF, with the value types they had."""
    for key, value in metadata.items():
        if not key.startswith("tokenizer."):
            continue
        if isinstance(value, list):
            kind = float if value and isinstance(value[0], float) else (
                str if value and isinstance(value[0], str) else int)
            writer.add_array(key, [kind(v) for v in value])
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            raise TypeError(f"tokenizer key {key}: unexpected {type(value).__name__}")

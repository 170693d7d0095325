"""Write a random-weight GGUF in llama.cpp's block formats, streamed to disk block by block.

For the real-size benchmarks (an 8B-shaped Q4_K_M file is 4.6 GB: no float model of it ever
exists, here or in the loader) and for tests of the block paths on tiny shapes. The default
model's tokenizer (its GGUF's `tokenizer.*` keys) stands in, so the vocabulary is its 49,152
tokens. Keys and tensor names are llama.cpp's for each architecture (src/llama-arch.cpp, the
converter's set_gguf_parameters), so llama-server loads the same file.

Shapes:
  LlamaShape     `llama`, or `qwen3moe` (q/k norms, every layer's MLP stacked experts behind an
                 F32 router) when num_experts > 0
  GptOssShape    `gpt-oss`: biased q/k/v/o, attn_sinks, post_attention_norm, a biased router,
                 ffn_{gate,up,down}_exps with biases; the window on even layers (llama.cpp's
                 pattern 2, no pattern key), YaRN keys as the converter writes the release's
  Llama4Shape    `llama4`: interleave_moe_layer_step, experts + ffn_*_shexp (the shared expert
                 of the experts' width, as llama.cpp builds it), the llama3 `rope_freqs`
                 tensor; no sliding_window key, as the converter writes Scout (llama.cpp and
                 hearth then chunk by 8192 and leave every 4th layer NoPE)

Block mixes:
  q4_k_m   llama.cpp's Q4_K_M recipe: every 2-D weight Q4_K, except output.weight and, in the
           first and last eighth of the layers and every third between, attn_v and ffn_down
           (ffn_down_exps, ffn_down_shexp), which are Q6_K
  q4_k     every 2-D weight Q4_K
  mxfp4    the experts MXFP4 (ggml type 39), every other 2-D weight Q8_0: how llama.cpp's
           gpt-oss files ship (hidden 2880 is not a multiple of K-quants' 256)
Norms are F32 ones, biases and sinks small F32 draws, routers F32 (llama-quantize keeps
ffn_gate_inp in F32). Scales are drawn so a weight's spread is ~1/sqrt(fan-in) (activations
stay O(1) through the layers; random bytes in the scale fields would make inf/NaN weights).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np

F32, Q8_0, Q4_K, Q6_K, MXFP4 = 0, 8, 12, 14, 39
# ggml type -> (values per block, bytes per block)
BLOCKS = {Q8_0: (32, 34), Q4_K: (256, 144), Q6_K: (256, 210), MXFP4: (32, 17)}
MIXES = ("q4_k_m", "q4_k", "mxfp4")


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
    default_mix: ClassVar[str] = "q4_k_m"

    @property
    def architecture(self) -> str:
        return "qwen3moe" if self.num_experts else "llama"


@dataclass(frozen=True)
class GptOssShape:
    """gpt-oss-20b's config but the layer count (the 120b: 36 layers, 128 experts)."""
    num_layers: int
    hidden_size: int = 2880
    num_heads: int = 64
    num_kv_heads: int = 8
    head_dim: int = 64
    num_experts: int = 32
    experts_per_tok: int = 4
    expert_intermediate_size: int = 2880
    sliding_window: int = 128
    architecture: ClassVar[str] = "gpt-oss"
    default_mix: ClassVar[str] = "mxfp4"

    @property
    def intermediate_size(self) -> int:
        return self.expert_intermediate_size  # what the converter writes as feed_forward_length


@dataclass(frozen=True)
class Llama4Shape:
    """Llama-4-Scout-17B-16E's text config but the layer count (Maverick: 128 experts, MoE
    every 2nd layer)."""
    num_layers: int
    hidden_size: int = 5120
    intermediate_size: int = 16384  # the dense layers' MLP (intermediate_size_mlp)
    num_heads: int = 40
    num_kv_heads: int = 8
    head_dim: int = 128
    num_experts: int = 16
    experts_per_tok: int = 1
    expert_intermediate_size: int = 8192
    interleave_moe_layer_step: int = 1  # every step-th layer is MoE
    architecture: ClassVar[str] = "llama4"
    default_mix: ClassVar[str] = "q4_k_m"


Shape = LlamaShape | GptOssShape | Llama4Shape

# Llama-3.1-8B, Qwen3-30B-A3B, Llama-3.2-1B (a quick check of the whole pipeline); gpt-oss-20b
# with 8 of its 24 layers (~3.9 GB); Llama 4 Scout with 4 of its 48 (~6.0 GB: 3 chunked RoPE
# layers, 1 NoPE)
SHAPES: dict[str, Shape] = {
    "llama8b": LlamaShape(32, 4096, 14336, 32, 8, 128),
    "qwen3-30b-a3b": LlamaShape(48, 2048, 6144, 32, 4, 128, num_experts=128, experts_per_tok=8,
                                expert_intermediate_size=768),
    "llama1b": LlamaShape(16, 2048, 8192, 32, 8, 64),
    "gpt-oss-20b-L8": GptOssShape(8),
    "scout-L4": Llama4Shape(4),
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


def q8_0_blocks(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """[rows, cols / 32 * 34] uint8 Q8_0 blocks (d fp16 | 32 int8): w = d q, spread ~73 d."""
    nb = rows * cols // 32
    out = rng.integers(0, 256, size=(nb, 34), dtype=np.uint8)
    d = (rng.uniform(0.5, 1.5, size=nb) / (73 * cols ** 0.5)).astype(np.float16)
    out[:, 0:2] = d.view(np.uint8).reshape(nb, 2)
    return out.reshape(rows, -1)


def mxfp4_blocks(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """[rows, cols / 32 * 17] uint8 ggml MXFP4 blocks (e8m0 exponent | 16 bytes of e2m1
    nibbles): w = e2m1(q) 2^(e - 127); uniform nibbles have an RMS of 2.93, so e is drawn
    around 127 + log2(1 / (2.93 sqrt(cols)))."""
    nb = rows * cols // 32
    out = rng.integers(0, 256, size=(nb, 17), dtype=np.uint8)
    centre = 127 + round(math.log2(1 / (2.93 * cols ** 0.5)))
    out[:, 0] = rng.integers(centre - 1, centre + 1, size=nb, dtype=np.uint8, endpoint=True)
    return out.reshape(rows, -1)


DRAW = {Q8_0: q8_0_blocks, Q4_K: q4_k_blocks, Q6_K: q6_k_blocks, MXFP4: mxfp4_blocks}


def block_types(mix: str, more: bool) -> dict[str, int]:
    """ggml type of each weight role under a mix (`more`: a use_more_bits layer)."""
    if mix not in MIXES:
        raise ValueError(f"mix: {mix!r} is not one of {', '.join(MIXES)}")
    if mix == "mxfp4":
        return {"w": Q8_0, "v_down": Q8_0, "exps": MXFP4, "down_exps": MXFP4, "output": Q8_0}
    k6 = Q6_K if mix == "q4_k_m" and more else Q4_K
    return {"w": Q4_K, "v_down": k6, "exps": Q4_K, "down_exps": k6,
            "output": Q6_K if mix == "q4_k_m" else Q4_K}


Plan = list[tuple[str, tuple, int]]


def tensor_plan(shape: Shape, vocab_size: int, mix: str) -> Plan:
    """(GGUF name, shape in torch order, ggml type) of every tensor, in file order."""
    s = shape
    out_types = block_types(mix, True)
    plan: Plan = [("token_embd.weight", (vocab_size, s.hidden_size), out_types["w"])]
    if isinstance(s, Llama4Shape):
        plan.append(("rope_freqs.weight", (s.head_dim // 2,), F32))
    for i in range(s.num_layers):
        plan += _layer_plan(s, f"blk.{i}.", block_types(mix, more_bits(i, s.num_layers)), i)
    return plan + [("output_norm.weight", (s.hidden_size,), F32),
                   ("output.weight", (vocab_size, s.hidden_size), out_types["output"])]


def _layer_plan(s: Shape, b: str, t: dict[str, int], index: int) -> Plan:
    h, q_rows, kv_rows = s.hidden_size, s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    attn = [(b + "attn_q.weight", (q_rows, h), t["w"]),
            (b + "attn_k.weight", (kv_rows, h), t["w"]),
            (b + "attn_v.weight", (kv_rows, h), t["v_down"]),
            (b + "attn_output.weight", (h, q_rows), t["w"])]
    e, width = s.num_experts, s.expert_intermediate_size
    experts = [(b + "ffn_gate_inp.weight", (e, h), F32),
               (b + "ffn_gate_exps.weight", (e, width, h), t["exps"]),
               (b + "ffn_up_exps.weight", (e, width, h), t["exps"]),
               (b + "ffn_down_exps.weight", (e, h, width), t["down_exps"])]
    if isinstance(s, GptOssShape):
        biases = [(b + f"attn_{x}.bias", (n,), F32)
                  for x, n in (("q", q_rows), ("k", kv_rows), ("v", kv_rows), ("output", h))]
        return [(b + "attn_norm.weight", (h,), F32), *attn, *biases,
                (b + "attn_sinks.weight", (s.num_heads,), F32),
                (b + "post_attention_norm.weight", (h,), F32), *experts,
                (b + "ffn_gate_inp.bias", (e,), F32),
                (b + "ffn_gate_exps.bias", (e, width), F32),
                (b + "ffn_up_exps.bias", (e, width), F32),
                (b + "ffn_down_exps.bias", (e, h), F32)]
    plan = [(b + "attn_norm.weight", (h,), F32), *attn, (b + "ffn_norm.weight", (h,), F32)]
    if isinstance(s, Llama4Shape):
        if (index + 1) % s.interleave_moe_layer_step:  # a dense layer
            return plan + _dense(b, h, s.intermediate_size, t)
        return plan + experts + _dense(b, h, width, t, "_shexp")
    if s.num_experts:
        return plan + [(b + "attn_q_norm.weight", (s.head_dim,), F32),
                       (b + "attn_k_norm.weight", (s.head_dim,), F32), *experts]
    return plan + _dense(b, h, s.intermediate_size, t)


def _dense(b: str, h: int, width: int, t: dict[str, int], suffix: str = "") -> Plan:
    return [(b + f"ffn_gate{suffix}.weight", (width, h), t["w"]),
            (b + f"ffn_up{suffix}.weight", (width, h), t["w"]),
            (b + f"ffn_down{suffix}.weight", (h, width), t["v_down"])]


def metadata(shape: Shape, context_length: int) -> dict[str, int | float | str]:
    """The architecture's keys (without the `{arch}.` prefix), as llama.cpp's converter writes
    them for the released config."""
    s = shape
    keys: dict[str, int | float | str] = {
        "block_count": s.num_layers, "context_length": context_length,
        "embedding_length": s.hidden_size, "feed_forward_length": s.intermediate_size,
        "attention.head_count": s.num_heads, "attention.head_count_kv": s.num_kv_heads,
        "attention.key_length": s.head_dim, "attention.value_length": s.head_dim,
        "rope.dimension_count": s.head_dim, "attention.layer_norm_rms_epsilon": 1e-5,
        "rope.freq_base": 500000.0}
    if s.num_experts:
        keys |= {"expert_count": s.num_experts, "expert_used_count": s.experts_per_tok,
                 "expert_feed_forward_length": s.expert_intermediate_size}
    if isinstance(s, GptOssShape):
        keys |= {"rope.freq_base": 150000.0, "attention.sliding_window": s.sliding_window,
                 "rope.scaling.type": "yarn", "rope.scaling.factor": 32.0,
                 "rope.scaling.original_context_length": 4096,
                 "rope.scaling.yarn_beta_fast": 32.0, "rope.scaling.yarn_beta_slow": 1.0}
    if isinstance(s, Llama4Shape):
        keys["interleave_moe_layer_step"] = s.interleave_moe_layer_step
    return keys


def f32_values(name: str, tshape: tuple, shape: Shape, rng: np.random.Generator) -> np.ndarray:
    """An F32 tensor's contents: norms ones, a router that spreads tokens over experts, small
    biases, O(1) sinks, Scout's llama3 RoPE divisors."""
    if name.endswith("norm.weight"):
        return np.ones(tshape, dtype=np.float32)
    if name == "rope_freqs.weight":
        from hearth.models.gguf_loader import llama3_freq_factors

        return llama3_freq_factors(shape.head_dim, 500000.0, 16.0, 1.0, 1.0, 8192).float().numpy()
    if name.endswith("ffn_gate_inp.weight"):
        return rng.standard_normal(tshape, dtype=np.float32) / tshape[1] ** 0.5
    if name.endswith("attn_sinks.weight"):
        return rng.standard_normal(tshape, dtype=np.float32)
    if name.endswith(".bias"):
        return 0.02 * rng.standard_normal(tshape, dtype=np.float32)
    raise ValueError(f"{name}: no rule for an F32 tensor")


def write_random_gguf(out: Path, shape: Shape, tokenizer_gguf: str | Path,
                      mix: str | None = None, seed: int = 0,
                      context_length: int = 131072) -> Path:
    """Write the file: header and tensor table first, then each tensor's blocks as drawn (one
    tensor's bytes in memory at a time). `mix`: the shape's default_mix when None."""
    import gguf

    from hearth.models.gguf_file import GGUFFile

    source = GGUFFile(tokenizer_gguf)
    vocab_size = source.tensors["token_embd.weight"].shape[0]
    plan = tensor_plan(shape, vocab_size, mix or shape.default_mix)
    arch = shape.architecture
    writer = gguf.GGUFWriter(str(out), arch)
    for key, value in metadata(shape, context_length).items():
        if isinstance(value, str):
            writer.add_string(f"{arch}.{key}", value)
        elif isinstance(value, float):
            writer.add_float32(f"{arch}.{key}", value)
        else:
            writer.add_uint32(f"{arch}.{key}", value)
    _copy_tokenizer(source.metadata, writer)
    for name, tshape, qtype in plan:
        if qtype == F32:
            writer.add_tensor_info(name, tshape, np.dtype(np.float32), 4 * int(np.prod(tshape)))
            continue
        per_block, block_bytes = BLOCKS[qtype]
        if tshape[-1] % per_block:
            raise ValueError(f"{name}: {gguf.GGMLQuantizationType(qtype).name} rows need a "
                             f"multiple of {per_block} columns, got {tshape}")
        row_bytes = tshape[-1] // per_block * block_bytes
        rows = int(np.prod(tshape[:-1]))
        writer.add_tensor_info(name, (*tshape[:-1], row_bytes), np.dtype(np.uint8),
                               rows * row_bytes, raw_dtype=gguf.GGMLQuantizationType(qtype))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, tshape, qtype in plan:
        if qtype == F32:
            writer.write_tensor_data(f32_values(name, tshape, shape, rng))
            continue
        rows = int(np.prod(tshape[:-1]))
        writer.write_tensor_data(DRAW[qtype](rng, rows, tshape[-1]).reshape(*tshape[:-1], -1))
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

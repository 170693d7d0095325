"""GGUF file -> ModelArch + HF-named float32 tensors.

Invariant: what `GGUFCheckpoint.get` returns is indistinguishable from the HF checkpoint the GGUF
was converted from (up to quantization): HF tensor names, `[out, in]` shapes, and Q/K rows in HF's
rotate-half RoPE order.

That last point needs care. For the llama architecture, llama.cpp's converter permuted the rows of
each attention head of Q and K so its interleaved RoPE (pairs (0,1), (2,3), ...) rotates the same
pairs as HF's rotate-half RoPE (pairs (j, j + head_dim/2)). Per head, GGUF row `2j + i` holds HF
row `i * head_dim/2 + j`; we undo that for the GGUF names a family lists in `gguf_permuted_qk`.
Qwen2/Qwen3 files use NEOX-style RoPE and are not permuted.

Which family a file is, and the tensor names and ModelArch fields beyond the shared ones, come
from the registry (hearth/models/registry.py). For an MLA family (DeepSeek, `deepseek2`), newer
converters store `kv_b_proj` as two tensors for llama.cpp's absorbed attention, per head h:

    attn_k_b [H, kv_lora_rank, nope] = W_UK_h^T      attn_v_b [H, v, kv_lora_rank] = W_UV_h
    kv_b_proj [H * (nope + v), kv_lora_rank] = per head [ attn_k_b[h]^T ; attn_v_b[h] ]

and `kv_b_proj` is rebuilt from them on read.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import torch

from hearth.models.arch import ModelArch
from hearth.models.checkpoint import Checkpoint, Shard, TokenizerSource, shard_bounds, take_shard
from hearth.models.dequant import SUPPORTED_TYPES, dequantize, is_supported
from hearth.models.families import Family
from hearth.models.gguf_file import GGUFFile
from hearth.models.registry import gguf_family

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# The Llama set of block tensors (a family adds its own: Family.gguf_tensor_names)
_BLOCK_STEMS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # a MoE layer's router [E, H]
}
# A MoE layer's experts, stacked ([E, I, H] / [E, H, I]): hearth's "stacked" expert layout
# (hearth.models.weights), named without a .weight suffix.
_EXPERT_NAMES = {"ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
                 "ffn_down_exps": "mlp.experts.down_proj"}
# GGUF block tensor ("name.kind" after "blk.{i}.") -> HF name after "model.layers.{i}."
BLOCK_NAMES = {**{f"{g}.{kind}": f"{h}.{kind}" for g, h in _BLOCK_STEMS.items()
                  for kind in ("weight", "bias")},
               **{f"{g}.weight": h for g, h in _EXPERT_NAMES.items()}}
# kv_b_proj split by newer converters (module docstring): (W_UK^T per head, W_UV per head)
_SPLIT_KV_B = ("attn_k_b", "attn_v_b")
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_ROPE_FREQS = "rope_freqs.weight"  # llama3-style RoPE scaling, stored as per-frequency divisors


def hf_tensor_name(gguf_name: str, block_names: dict[str, str] = BLOCK_NAMES) -> str | None:
    """The HF name of a GGUF tensor, or None if it is not one of `block_names` (the Llama set,
    or a family's with its own added) or a global tensor."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _BLOCK_TENSOR.fullmatch(gguf_name)
    if match is None or f"{match[2]}.{match[3]}" not in block_names:
        return None
    return f"model.layers.{match[1]}.{block_names[f'{match[2]}.{match[3]}']}"


class GGUFCheckpoint(Checkpoint):
    def __init__(self, path: str | Path, name: str | None = None) -> None:
        self.file = GGUFFile(path)
        meta = self.file.metadata
        architecture = self.file.architecture
        self.family, arch_name = gguf_family(
            architecture, bool(meta.get(f"{architecture}.expert_count")), path)
        self._permuted_qk = architecture in self.family.gguf_permuted_qk
        block_names = {**BLOCK_NAMES, **self.family.gguf_tensor_names}
        self._hf_to_gguf: dict[str, str] = {}
        # HF kv_b_proj name -> (attn_k_b, attn_v_b) GGUF names it is rebuilt from
        self._split_kv_b: dict[str, tuple[str, str]] = {}
        for gguf_name, info in self.file.tensors.items():
            if gguf_name == _ROPE_FREQS:
                continue
            hf_name = hf_tensor_name(gguf_name, block_names)
            is_split_half = (hf_name is None and self.family.uses_mla
                             and self._note_split_kv_b(gguf_name))
            if hf_name is None and not is_split_half:
                raise ValueError(f"{path}: unexpected tensor {gguf_name!r} for a {architecture} model")
            if not is_supported(info.ggml_type):
                raise ValueError(
                    f"{path}: tensor {gguf_name!r} has quantization type "
                    f"{_type_name(info.ggml_type)}, which hearth cannot dequantize "
                    f"(supported: {', '.join(SUPPORTED_TYPES)})"
                )
            if hf_name is not None:
                self._hf_to_gguf[hf_name] = gguf_name
        # a file holding both forms: kv_b_proj as stored, the split copies unread
        for hf_name in set(self._split_kv_b) & set(self._hf_to_gguf):
            del self._split_kv_b[hf_name]
        self.arch = arch_from_gguf(meta, self.file, self.family, arch_name)
        self.name = name or self.file.path.stem
        self.tokenizer_source = TokenizerSource(gguf_metadata=meta)

    def _note_split_kv_b(self, gguf_name: str) -> bool:
        """Whether `gguf_name` is one half of a split kv_b_proj (recorded under its HF name).
        Both halves must be in the file."""
        match = _BLOCK_TENSOR.fullmatch(gguf_name)
        if match is None or match[2] not in _SPLIT_KV_B or match[3] != "weight":
            return False
        names = tuple(f"blk.{match[1]}.{part}.weight" for part in _SPLIT_KV_B)
        missing = [n for n in names if n not in self.file.tensors]
        if missing:
            raise ValueError(f"{self.file.path}: {gguf_name!r} without {missing[0]!r} "
                             f"(kv_b_proj of layer {match[1]} is stored as both)")
        self._split_kv_b[f"model.layers.{match[1]}.self_attn.kv_b_proj.weight"] = names
        return True

    def tensor_names(self) -> list[str]:
        return list(self._hf_to_gguf) + list(self._split_kv_b)

    def _joined_kv_b(self, name: str) -> torch.Tensor:
        """kv_b_proj [H * (nope + v), L] from attn_k_b [H, L, nope] and attn_v_b [H, v, L]."""
        k_b, v_b = (self.file.tensors[n] for n in self._split_kv_b[name])
        w_uk = dequantize(self.file.raw(k_b.name), k_b.ggml_type, k_b.shape)
        w_uv = dequantize(self.file.raw(v_b.name), v_b.ggml_type, v_b.shape)
        if (w_uk.dim() != 3 or w_uv.dim() != 3 or w_uk.shape[0] != w_uv.shape[0]
                or w_uk.shape[1] != w_uv.shape[2]):
            raise ValueError(f"{self.file.path}: {k_b.name} {tuple(k_b.shape)} and {v_b.name} "
                             f"{tuple(v_b.shape)} are not [heads, kv_lora_rank, nope] and "
                             f"[heads, v, kv_lora_rank]")
        joined = torch.cat([w_uk.transpose(1, 2), w_uv], dim=1)  # [H, nope + v, L]
        return joined.reshape(-1, joined.shape[2])

    def get(self, name: str, shard: Shard | None = None) -> torch.Tensor:
        if name in self._split_kv_b:
            return take_shard(self._joined_kv_b(name), shard, name)
        if name not in self._hf_to_gguf:
            raise KeyError(f"{self.file.path} has no tensor {name!r}")
        info = self.file.tensors[self._hf_to_gguf[name]]
        num_heads = self._permuted_heads(name)
        raw = self.file.raw(info.name)
        shape = info.shape
        if shard is not None and len(shape) == 2 and shard[0] in (0, 1, -1, -2):
            # Read only the shard's bytes when it covers whole rows (and whole heads, for a
            # permuted Q/K) or whole quant blocks of each row.
            dim = shard[0] % 2
            start, stop = shard_bounds(shape[dim], shard, name)
            if dim == 0 and (num_heads is None or (stop - start) % (shape[0] // num_heads) == 0):
                row_bytes = info.num_bytes // shape[0]
                raw = raw[start * row_bytes : stop * row_bytes]
                if num_heads is not None:
                    num_heads = num_heads * (stop - start) // shape[0]
                shape, shard = (stop - start, shape[1]), None
            elif dim == 1 and _block_aligned(info.ggml_type, start, stop):
                block_size, type_size = _block_layout(info.ggml_type)
                blocks = raw.view(shape[0], shape[1] // block_size, type_size)
                raw = blocks[:, start // block_size : stop // block_size].reshape(-1)
                shape, shard = (shape[0], stop - start), None
        tensor = dequantize(raw, info.ggml_type, shape)
        if num_heads is not None:
            tensor = unpermute_qk(tensor, num_heads)
        return take_shard(tensor, shard, name)

    def read_into(self, out: torch.Tensor, name: str, shard: Shard | None = None) -> None:
        """Dequantize straight into `out` when it takes float32 values of the whole tensor;
        Q/K rows are un-permuted as bytes first (whole rows of blocks move, so no value
        changes). Shards and other dtypes go through `get`."""
        info = self.file.tensors.get(self._hf_to_gguf.get(name, ""))
        if (shard is not None or info is None or out.dtype != torch.float32
                or not out.is_contiguous() or out.device.type != "cpu"
                or tuple(out.shape) != tuple(info.shape)):
            return super().read_into(out, name, shard)
        raw = self.file.raw(info.name)
        num_heads = self._permuted_heads(name)
        if num_heads is not None:
            raw = unpermute_qk(raw.view(info.shape[0], -1), num_heads).view(-1)
        dequantize(raw, info.ggml_type, info.shape, out=out)

    def raw_blocks(self, name: str) -> tuple[int, torch.Tensor] | None:
        """(ggml type, `[rows, row_bytes]` uint8) of a 2-D tensor as stored, rows in HF order
        (Q/K rows un-permuted: whole rows of blocks move, so no value changes), or None when the
        tensor is not stored in a block format the CPU kernels read (see hearth.ops.cpu_kernels)."""
        from hearth.ops.cpu_kernels import QTYPES

        info = self.file.tensors.get(self._hf_to_gguf.get(name, ""))
        if info is None or len(info.shape) not in (2, 3) or info.ggml_type not in QTYPES:
            return None
        # a 3-D tensor (stacked experts): every expert's rows, one after another
        rows = self.file.raw(info.name).view(math.prod(info.shape[:-1]), -1)
        num_heads = self._permuted_heads(name)
        if num_heads is not None:
            rows = unpermute_qk(rows, num_heads)
        return info.ggml_type, rows.contiguous()

    def stored_type(self, name: str) -> int | None:
        """The ggml type `name` is stored in (None: not one stored tensor, e.g. a kv_b_proj
        joined from two)."""
        info = self.file.tensors.get(self._hf_to_gguf.get(name, ""))
        return None if info is None else info.ggml_type

    def release_pages(self, name: str | None = None) -> None:
        """Drop this process's mapped pages of `name`'s bytes (None: the whole file): after a
        load has copied them, so the map adds nothing to the process's resident memory."""
        if name is None:
            self.file.release()
            return
        for gguf_name in self._split_kv_b.get(name, (self._hf_to_gguf.get(name),)):
            if gguf_name is not None:
                self.file.release(gguf_name)

    def stored_shape(self, name: str) -> tuple[int, ...]:
        """The shape (torch order) `name` is stored in, read from the header alone."""
        return self.file.tensors[self._hf_to_gguf[name]].shape

    def stored_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of the tensor seen as [rows, cols] (a 3-D expert stack:
        expert-major), dequantized to float32 from those rows' bytes alone (a permuted Q/K is
        read whole and un-permuted first)."""
        info = self.file.tensors[self._hf_to_gguf[name]]
        cols = info.shape[-1]
        if self._permuted_heads(name) is not None:
            return self.get(name).reshape(-1, cols)[start:stop]
        row_bytes = info.num_bytes // math.prod(info.shape[:-1])
        raw = self.file.raw(info.name)[start * row_bytes : stop * row_bytes]
        return dequantize(raw, info.ggml_type, (stop - start, cols))

    def _permuted_heads(self, name: str) -> int | None:
        """Number of heads whose rows the converter permuted in this tensor (None: not permuted)."""
        if not self._permuted_qk:
            return None
        if ".self_attn.q_proj." in name:
            return self.arch.num_heads
        if ".self_attn.k_proj." in name:
            return self.arch.num_kv_heads
        return None


def unpermute_qk(tensor: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (see module docstring). Works for weights and biases."""
    rows = tensor.shape[0]
    half = rows // num_heads // 2
    # [num_heads, half, 2, ...] (GGUF) -> [num_heads, 2, half, ...] (HF)
    per_head = tensor.reshape(num_heads, half, 2, *tensor.shape[1:])
    return per_head.transpose(1, 2).reshape(tensor.shape).contiguous()


def arch_from_gguf(meta: dict[str, Any], file: GGUFFile, family: Family,
                   architecture: str) -> ModelArch:
    """The fields every family reads alike (from the metadata keys and which tensors the file
    has), then its family's own (`Family.gguf_fields`: MoE and MLA specs, head widths) over
    them."""
    prefix = meta["general.architecture"]

    def key(suffix: str, default: Any = None) -> Any:
        value = meta.get(f"{prefix}.{suffix}", default)
        if value is None:
            raise ValueError(f"{file.path}: GGUF metadata has no {prefix}.{suffix}")
        return value

    hidden_size = int(key("embedding_length"))
    num_heads = int(key("attention.head_count"))
    rope_theta = float(key("rope.freq_base", 10000.0))
    eos_ids = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    own = family.gguf_fields(meta, file, key, architecture)
    moe = own.get("moe")
    head_dim = own.get("head_dim", int(key("attention.key_length", hidden_size // num_heads)))
    fields = dict(
        architecture=architecture,
        vocab_size=file.tensors["token_embd.weight"].shape[0],
        hidden_size=hidden_size,
        intermediate_size=int(meta.get(f"{prefix}.feed_forward_length")
                              or (moe.expert_intermediate_size if moe else key("feed_forward_length"))),
        num_layers=int(key("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(key("attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        max_position_embeddings=int(key("context_length")),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_theta=rope_theta,
        rope_scaling=_rope_scaling(meta, prefix, file, head_dim, rope_theta),
        tie_word_embeddings="output.weight" not in file.tensors,
        attention_bias="blk.0.attn_q.bias" in file.tensors,
        attention_out_bias="blk.0.attn_output.bias" in file.tensors,
        mlp_bias="blk.0.ffn_up.bias" in file.tensors,
        qk_norm="blk.0.attn_q_norm.weight" in file.tensors,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(int(i) for i in eos_ids if i is not None)),
    )
    return ModelArch(**{**fields, **own})


def _rope_scaling(
    meta: dict[str, Any], prefix: str, file: GGUFFile, head_dim: int, rope_theta: float
) -> dict | None:
    """GGUF rope-scaling keys (or a rope_freqs tensor) -> HF `rope_scaling` dict."""
    if _ROPE_FREQS in file.tensors:
        freq_factors = dequantize(file.raw(_ROPE_FREQS), file.tensors[_ROPE_FREQS].ggml_type, (-1,))
        return llama3_scaling_from_freq_factors(freq_factors, head_dim, rope_theta, file.path)
    kind = meta.get(f"{prefix}.rope.scaling.type", "none")
    factor = meta.get(f"{prefix}.rope.scaling.factor", meta.get(f"{prefix}.rope.scale_linear"))
    if kind == "none" and factor is not None and float(factor) != 1.0:
        kind = "linear"  # old files: only rope.scale_linear
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        scaling = {
            "rope_type": "yarn",
            "factor": float(factor),
            "original_max_position_embeddings": int(meta[f"{prefix}.rope.scaling.original_context_length"]),
        }
        for gguf_key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if f"{prefix}.rope.scaling.{gguf_key}" in meta:
                scaling[hf_key] = float(meta[f"{prefix}.rope.scaling.{gguf_key}"])
        log_multiplier = float(meta.get(f"{prefix}.rope.scaling.yarn_log_multiplier") or 0.0)
        if log_multiplier:
            # DeepSeek: the converter writes 0.1 * mscale_all_dim, and llama.cpp runs deepseek2
            # with mscale = mscale_all_dim (the released DeepSeek and Kimi configs set both
            # alike): the rotary tables unscaled, the softmax scaled by mscale_all_dim-derived
            # mscale^2 (hearth's mla_softmax_scale).
            scaling["mscale"] = scaling["mscale_all_dim"] = log_multiplier / 0.1
        return scaling
    raise ValueError(f"{file.path}: RoPE scaling type {kind!r} is not supported")


def llama3_freq_factors(
    head_dim: int, rope_theta: float, factor: float, low_freq_factor: float,
    high_freq_factor: float, original_max_position_embeddings: int,
) -> torch.Tensor:
    """Per-frequency divisors of llama3 RoPE scaling (what llama.cpp stores as rope_freqs)."""
    inv_freq = 1.0 / rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    medium = 1.0 / ((1 - smooth) / factor + smooth)
    low_wavelen = original_max_position_embeddings / low_freq_factor
    high_wavelen = original_max_position_embeddings / high_freq_factor
    factors = torch.where(wavelen > low_wavelen, torch.full_like(wavelen, factor), medium)
    return torch.where(wavelen < high_wavelen, torch.ones_like(wavelen), factors)


def llama3_scaling_from_freq_factors(
    freq_factors: torch.Tensor, head_dim: int, rope_theta: float, path: Path
) -> dict:
    """Recover HF llama3 `rope_scaling` from llama.cpp's rope_freqs tensor.

    The file stores only the computed divisors; every Llama 3.x release uses low/high frequency
    factors 1 and 4 over an 8192-token original context, Llama 4 (Scout) 1 and 1, so we try
    those and accept one only if it reproduces the stored divisors.
    """
    factor = round(float(freq_factors.max()), 3)  # stored in float32: 8.000001 -> 8.0
    for low, high in ((1.0, 4.0), (1.0, 1.0)):
        params = {"factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                  "original_max_position_embeddings": 8192}
        expected = llama3_freq_factors(head_dim, rope_theta, **params)
        if expected.shape == freq_factors.shape and torch.allclose(
                expected, freq_factors.double(), rtol=1e-3):
            return {"rope_type": "llama3", **params}
    raise ValueError(f"{path}: {_ROPE_FREQS} does not match llama3 RoPE scaling; not supported")


def _block_layout(ggml_type: int) -> tuple[int, int]:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    return GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]


def _block_aligned(ggml_type: int, start: int, stop: int) -> bool:
    block_size = _block_layout(ggml_type)[0]
    return start % block_size == 0 and stop % block_size == 0


def _type_name(ggml_type: int) -> str:
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType(ggml_type).name

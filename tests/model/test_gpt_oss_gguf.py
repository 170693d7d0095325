"""gpt-oss as llama.cpp's `gpt-oss` GGUF: the same weights as a transformers checkpoint give its
logits and greedy tokens, experts in floats or MXFP4 blocks.

The files are written here as llama.cpp's convert_hf_to_gguf.py (GptOssModel) writes them:
the experts' interleaved gate/up columns split into ffn_gate_exps / ffn_up_exps [E, I, H]
(biases [E, I]), ffn_down_exps [E, H, I], sinks as attn_sinks, the norm before the MLP as
post_attention_norm, the biased router as ffn_gate_inp, YaRN's type / factor / original
context, the window as attention.sliding_window and no layer pattern (llama.cpp slides the
even layers, transformers' default layer_types), the SwiGLU limit per layer as
swiglu_clamp_exp (the tests' limit cuts; llama.cpp's default is the released 7). MXFP4
experts are gguf's own quantizer's blocks; transformers then holds gguf's dequantization of
them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import tests.model.test_gpt_oss as oss
import tests.model.test_hf_parity as parity
from hearth.engine.llm import LLM
from hearth.models.hf_loader import HFCheckpoint
from hearth.models.weights import build_model
from tests.model.test_hf_parity import PagedRun, check_engine_greedy, hf_logits

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

PROMPT = oss.PROMPT[:40]  # past three windows


class GgufRun(PagedRun):
    """PagedRun over a GGUF file (or `model`, built from one)."""

    def __init__(self, path: Path, model=None) -> None:
        from hearth.models.gguf_loader import GGUFCheckpoint

        self.model = model or build_model(GGUFCheckpoint(path), torch.float32)
        planes, heads, dim = self.model.arch.kv_cache_layout()
        self.kv_cache = torch.zeros(len(self.model.layers), planes, parity.NUM_BLOCKS,
                                    parity.BLOCK_SIZE, heads, dim)
        self.block_table = list(range(parity.NUM_BLOCKS - 1, -1, -1))
        self.num_computed = 0


def write_gpt_oss_gguf(path: Path, model, expert_qtype=None, drop_tensors: tuple[str, ...] = (),
                       write_pattern: bool = False, linear_qtype=None,
                       drop_keys: tuple[str, ...] = (),
                       limits: list[float] | None = None) -> dict[str, torch.Tensor]:
    """`model`'s weights as llama.cpp converts them (module docstring); the experts in
    `expert_qtype`, the attention projections and output head in `linear_qtype` (None:
    F32); `drop_keys` left out, `limits` the per-layer swiglu_clamp_exp. Returns the HF state
    dict holding what the file holds (quantized tensors' dequantized blocks)."""
    import numpy as np
    from gguf.quants import dequantize, quantize

    config, state = model.config, {k: v.clone() for k, v in model.state_dict().items()}
    arch = "gpt-oss"
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in {
        "block_count": config.num_hidden_layers,
        "context_length": config.max_position_embeddings,
        "embedding_length": config.hidden_size,
        "feed_forward_length": config.intermediate_size,
        "attention.head_count": config.num_attention_heads,
        "attention.head_count_kv": config.num_key_value_heads,
        "attention.key_length": config.head_dim, "attention.value_length": config.head_dim,
        "expert_count": config.num_local_experts,
        "expert_used_count": config.num_experts_per_tok,
        "expert_feed_forward_length": config.intermediate_size,
        "attention.sliding_window": config.sliding_window,
        "rope.scaling.original_context_length":
            config.rope_parameters["original_max_position_embeddings"],
    }.items():
        if key not in drop_keys:
            writer.add_uint32(f"{arch}.{key}", value)
    if write_pattern:
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in config.layer_types])
    writer.add_swiglu_clamp_exp(limits or [config.swiglu_limit] * config.num_hidden_layers)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", config.rms_norm_eps)
    writer.add_float32(f"{arch}.rope.freq_base", config.rope_parameters["rope_theta"])
    writer.add_string(f"{arch}.rope.scaling.type", "yarn")
    writer.add_float32(f"{arch}.rope.scaling.factor", config.rope_parameters["factor"])
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([chr(ord("a") + i % 26) * (1 + i // 26)
                           for i in range(config.vocab_size)])
    writer.add_token_merges(["a a"])  # the writer drops an empty list
    writer.add_eos_token_id(config.eos_token_id)

    def add(name: str, tensor: torch.Tensor, qtype=None) -> torch.Tensor:
        """Write `tensor`; return what the file holds, as float32."""
        data = np.ascontiguousarray(tensor.float().numpy())
        if qtype is not None:
            data = quantize(data, qtype)
            if name not in drop_tensors:
                writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
            return torch.from_numpy(dequantize(data, qtype).copy())
        if name not in drop_tensors:
            writer.add_tensor(name, data)
        return tensor

    add("token_embd.weight", state["model.embed_tokens.weight"])
    add("output_norm.weight", state["model.norm.weight"])
    state["lm_head.weight"] = add("output.weight", state["lm_head.weight"], linear_qtype)
    for i in range(config.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        for hf, gg in (("input_layernorm.weight", "attn_norm.weight"),
                       ("post_attention_layernorm.weight", "post_attention_norm.weight"),
                       ("self_attn.sinks", "attn_sinks.weight"),
                       ("mlp.router.weight", "ffn_gate_inp.weight"),
                       ("mlp.router.bias", "ffn_gate_inp.bias"),
                       *((f"self_attn.{x}_proj.{kind}", f"attn_{y}.{kind}")
                         for x, y in (("q", "q"), ("k", "k"), ("v", "v"), ("o", "output"))
                         for kind in ("weight", "bias"))):
            quantized = hf.endswith("_proj.weight")
            state[p + hf] = add(b + gg, state[p + hf], linear_qtype if quantized else None)
        e = p + "mlp.experts."
        gate_up = state[e + "gate_up_proj"].transpose(1, 2)  # [E, 2I, H], rows interleaved
        gate = add(b + "ffn_gate_exps.weight", gate_up[:, 0::2], expert_qtype)
        up = add(b + "ffn_up_exps.weight", gate_up[:, 1::2], expert_qtype)
        down = add(b + "ffn_down_exps.weight", state[e + "down_proj"].transpose(1, 2),
                   expert_qtype)
        joined = torch.stack([gate, up], dim=2).reshape(gate_up.shape)  # interleaved again
        state[e + "gate_up_proj"] = joined.transpose(1, 2)
        state[e + "down_proj"] = down.transpose(1, 2)
        bias = state[e + "gate_up_proj_bias"]
        add(b + "ffn_gate_exps.bias", bias[:, 0::2])
        add(b + "ffn_up_exps.bias", bias[:, 1::2])
        add(b + "ffn_down_exps.bias", state[e + "down_proj_bias"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return state


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """transformers' default layer_types (sliding, full, sliding), as llama.cpp runs them."""
    folder = tmp_path_factory.mktemp("gpt_oss_gguf") / "m"
    return oss.make_gpt_oss(folder, layer_types=None), folder


@pytest.fixture
def long_cache(monkeypatch):
    monkeypatch.setattr(parity, "NUM_BLOCKS", 24)


@pytest.mark.parametrize("expert_qtype", [None, "MXFP4"], ids=["f32", "mxfp4"])
def test_gguf_gives_the_checkpoints_arch_and_logits(hf_model, tmp_path, long_cache,
                                                    expert_qtype):
    """The file's arch is the HF folder's; hearth's logits over the file (whole prompt, then
    chunks and decodes over the cache) are transformers' over the same weights."""
    from hearth.models.gguf_loader import GGUFCheckpoint

    model, folder = hf_model
    qtype = None if expert_qtype is None else gguf.GGMLQuantizationType[expert_qtype]
    path = tmp_path / "m.gguf"
    state = write_gpt_oss_gguf(path, model, qtype)
    checkpoint = GGUFCheckpoint(path)
    arch, want = checkpoint.arch, HFCheckpoint(folder).arch
    assert checkpoint.stored_type("model.layers.0.mlp.experts.down_proj") == (
        qtype or gguf.GGMLQuantizationType.F32)
    assert arch.family_spec == want.family_spec
    assert arch.family_spec.sliding_layers == (True, False, True)
    assert (arch.moe, arch.rope_scaling, arch.rope_theta) == (want.moe, want.rope_scaling,
                                                              want.rope_theta)
    assert (arch.attention_bias, arch.attention_out_bias, arch.qk_norm,
            arch.tie_word_embeddings) == (True, True, False, False)
    reference = transformers.GptOssForCausalLM(model.config).to(torch.float32).eval()
    reference.load_state_dict(state)
    if qtype is not None:  # the blocks round: transformers holds their values, not the floats
        name = "model.layers.0.mlp.experts.gate_up_proj"
        assert not torch.equal(state[name], model.state_dict()[name])
    logits = hf_logits(reference, PROMPT)
    run = GgufRun(path)
    chunked = [run.step(PROMPT[:13]), run.step(PROMPT[13:30])]
    chunked += [run.step([token]) for token in PROMPT[30:]]
    for got in (GgufRun(path).step(PROMPT), torch.cat(chunked)):
        torch.testing.assert_close(got, logits, atol=parity.ATOL, rtol=0)


def test_a_layer_pattern_in_the_file_is_read(tmp_path):
    """A file with attention.sliding_window_pattern slides the layers it names (here the
    test_gpt_oss checkpoint's sliding, full, full), not llama.cpp's alternation."""
    from hearth.models.gguf_loader import GGUFCheckpoint

    model = oss.make_gpt_oss(tmp_path / "m")
    write_gpt_oss_gguf(tmp_path / "m.gguf", model, write_pattern=True)
    spec = GGUFCheckpoint(tmp_path / "m.gguf").arch.family_spec
    assert spec == HFCheckpoint(tmp_path / "m").arch.family_spec
    assert spec.sliding_layers == (True, False, False)


def test_quantization_gguf_runs_the_files_linears_and_mxfp4_experts(hf_model, tmp_path,
                                                                    long_cache):
    """`gguf` (what `auto` picks for a GGUF): the attention projections multiply in the file's
    Q8_0 blocks, and the MXFP4 expert stacks are packed straight from the file (blocks only,
    no float copy), run by the expert kernel with their biases and clamped SwiGLU; logits as
    the float model of the same file."""
    from hearth.engine.executor import build_model_for
    from hearth.engine.llm import make_engine_config
    from hearth.models.gguf_loader import GGUFCheckpoint
    from hearth.ops.cpu_kernels import load_cpu_kernels

    if load_cpu_kernels() is None:
        pytest.skip("hearth's CPU kernels are not built here")
    model, _ = hf_model
    path = tmp_path / "q.gguf"
    write_gpt_oss_gguf(path, model, gguf.GGMLQuantizationType.MXFP4,
                       linear_qtype=gguf.GGMLQuantizationType.Q8_0)
    checkpoint = GGUFCheckpoint(path)

    def build(quantization: str):
        config = make_engine_config(str(path), quantization=quantization, **oss.EXACT)
        return build_model_for(config, checkpoint).model

    served = build("gguf")
    attn, experts = served.layers[0].self_attn, served.layers[0].mlp.experts
    assert attn.qkv_proj.qweight.qtype == gguf.GGMLQuantizationType.Q8_0.value
    assert experts.blocks_only and experts.qw13.qtype == experts.qw2.qtype == 39  # MXFP4
    torch.testing.assert_close(GgufRun(path, served).step(PROMPT),
                               GgufRun(path, build("none")).step(PROMPT), atol=1e-3, rtol=0)


def test_engine_greedy_tokens_equal_transformers(hf_model, tmp_path):
    """Through the engine (chunked prefill, prefix hits on the second round): transformers'
    greedy tokens and logprobs, MXFP4 experts."""
    model, _ = hf_model
    path = tmp_path / "m.gguf"
    state = write_gpt_oss_gguf(path, model, gguf.GGMLQuantizationType.MXFP4)
    reference = transformers.GptOssForCausalLM(model.config).to(torch.float32).eval()
    reference.load_state_dict(state)
    prompts = oss.PROMPTS[:4]
    check_engine_greedy(path, reference, prompts, oss.GREEDY, **oss.EXACT, quantization="none", max_num_batched_tokens=16)


def test_a_truncated_or_incomplete_file_is_refused_naming_the_tensor(hf_model, tmp_path):
    from hearth.models.gguf_loader import GGUFCheckpoint

    model, _ = hf_model
    path = tmp_path / "m.gguf"
    write_gpt_oss_gguf(path, model, gguf.GGMLQuantizationType.MXFP4)
    data = path.read_bytes()
    last = GGUFCheckpoint(path).file.tensors
    last_name = max(last, key=lambda n: last[n].offset)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:-100])
    with pytest.raises(ValueError, match=rf"{last_name}.*truncated"):
        GGUFCheckpoint(cut)
    for dropped, match in (("blk.1.attn_sinks.weight", r"model\.layers\.1\.self_attn\.sinks"),
                           ("blk.2.ffn_up_exps.bias",
                            r"model\.layers\.2\.mlp\.experts\.up_proj_bias")):
        write_gpt_oss_gguf(tmp_path / "d.gguf", model, drop_tensors=(dropped,))
        with pytest.raises((ValueError, KeyError), match=match):
            LLM(str(tmp_path / "d.gguf"), **oss.EXACT, quantization="none")


@pytest.mark.parametrize("drop_keys,limits,match", [
    (("attention.sliding_window",), None, r"no gpt-oss\.attention\.sliding_window"),
    (("expert_feed_forward_length",), None, r"no gpt-oss\.expert_feed_forward_length"),
    ((), [1.5, 7.0, 1.5], r"swiglu_clamp_exp \[1\.5, 7\.0, 1\.5\] is not one limit"),
], ids=["sliding_window", "expert_feed_forward_length", "unequal-limits"])
def test_missing_or_unusable_metadata_is_refused_naming_the_key(hf_model, tmp_path, drop_keys,
                                                                 limits, match):
    from hearth.models.gguf_loader import GGUFCheckpoint

    model, _ = hf_model
    path = tmp_path / "m.gguf"
    write_gpt_oss_gguf(path, model, drop_keys=drop_keys, limits=limits)
    with pytest.raises(ValueError, match=match):
        GGUFCheckpoint(path)

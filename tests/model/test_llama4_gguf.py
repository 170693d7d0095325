"""Llama 4 (text) as llama.cpp's `llama4` GGUF: the same weights as a transformers checkpoint
give its logits and greedy tokens.

The files are written here as llama.cpp's convert_hf_to_gguf.py (Llama4Model) writes them: q/k
rows as stored (interleaved rotary pairs, undo_permute off), the experts' packed gate_up split
into ffn_gate_exps / ffn_up_exps [E, I, H] and ffn_down_exps [E, H, I], the shared expert as
ffn_*_shexp, the router as ffn_gate_inp, dense layers' MLPs as ffn_{gate,up,down},
feed_forward_length the dense width, interleave_moe_layer_step, and llama3 RoPE scaling as the
rope_freqs divisors (Scout's low = high frequency factor 1). The tiny model's chunk size, NoPE
interval and temperature settings differ from llama.cpp's built-in ones, so its file carries
them in attention.sliding_window / sliding_window_pattern / temperature_length /
temperature_scale; a file without them gets llama.cpp's (test_defaults...).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tests.model.test_hf_parity as parity
import tests.model.test_llama4 as l4
from hearth.engine.llm import LLM
from hearth.models.hf_loader import HFCheckpoint
from tests.model.test_gpt_oss_gguf import GgufRun
from tests.model.test_hf_parity import check_engine_greedy, hf_logits

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

# Scout's RoPE scaling (original context 8192, as llama.cpp's rope_freqs reader assumes)
SCOUT_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0,
              "low_freq_factor": 1.0, "high_freq_factor": 1.0,
              "original_max_position_embeddings": 8192}


def write_llama4_gguf(path: Path, model, qtype=None, settings: bool = True,
                      drop_tensors: tuple[str, ...] = (), drop_keys: tuple[str, ...] = (),
                      pattern=None) -> Path:
    """`model`'s weights as llama.cpp converts them (module docstring); the linears (not the
    router or norms) in `qtype` (None: F32); `settings`: write the chunk / pattern /
    temperature keys (`pattern`: the sliding_window_pattern written instead of the NoPE
    interval); `drop_keys` left out."""
    import numpy as np
    from gguf.quants import quantize

    from hearth.models.gguf_loader import llama3_freq_factors

    config, state = model.config, model.state_dict()
    arch, inter = "llama4", config.intermediate_size
    writer = gguf.GGUFWriter(str(path), arch)
    keys = {"block_count": config.num_hidden_layers,
            "context_length": config.max_position_embeddings,
            "embedding_length": config.hidden_size,
            "feed_forward_length": config.intermediate_size_mlp,
            "attention.head_count": config.num_attention_heads,
            "attention.head_count_kv": config.num_key_value_heads,
            "attention.key_length": config.head_dim, "attention.value_length": config.head_dim,
            "rope.dimension_count": config.head_dim,
            "expert_count": config.num_local_experts,
            "expert_used_count": config.num_experts_per_tok,
            "expert_feed_forward_length": inter,
            "interleave_moe_layer_step": config.interleave_moe_layer_step}
    if settings:
        keys.update({"attention.sliding_window": config.attention_chunk_size,
                     "attention.sliding_window_pattern": config.no_rope_layer_interval})
        if pattern is not None:
            del keys["attention.sliding_window_pattern"]
            writer.add_sliding_window_pattern(pattern)
        writer.add_float32(f"{arch}.attention.temperature_length", config.floor_scale)
        writer.add_float32(f"{arch}.attention.temperature_scale", config.attn_scale)
    for key, value in keys.items():
        if key not in drop_keys:
            writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", config.rms_norm_eps)
    rope = config.rope_parameters
    writer.add_float32(f"{arch}.rope.freq_base", rope["rope_theta"])
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([chr(ord("a") + i % 26) * (1 + i // 26)
                           for i in range(config.vocab_size)])
    writer.add_token_merges(["a a"])
    writer.add_eos_token_id(config.eos_token_id)

    def add(name: str, tensor: torch.Tensor, quantized: bool = False) -> None:
        if name in drop_tensors:
            return
        data = np.ascontiguousarray(tensor.float().numpy())
        if quantized and qtype is not None:
            data = quantize(data, qtype)
            writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
        else:
            writer.add_tensor(name, data)

    add("rope_freqs.weight", llama3_freq_factors(
        config.head_dim, rope["rope_theta"], rope["factor"], rope["low_freq_factor"],
        rope["high_freq_factor"], rope["original_max_position_embeddings"]).float())
    add("token_embd.weight", state["model.embed_tokens.weight"])
    add("output_norm.weight", state["model.norm.weight"])
    add("output.weight", state["lm_head.weight"], True)
    for i in range(config.num_hidden_layers):
        p, b, f = f"model.layers.{i}.", f"blk.{i}.", f"model.layers.{i}.feed_forward."
        for hf, gg in (("input_layernorm", "attn_norm"), ("post_attention_layernorm", "ffn_norm"),
                       ("self_attn.q_proj", "attn_q"), ("self_attn.k_proj", "attn_k"),
                       ("self_attn.v_proj", "attn_v"), ("self_attn.o_proj", "attn_output")):
            add(b + gg + ".weight", state[p + hf + ".weight"], hf.endswith("_proj"))
        if f + "router.weight" not in state:
            for x in ("gate", "up", "down"):
                add(b + f"ffn_{x}.weight", state[f + f"{x}_proj.weight"], True)
            continue
        add(b + "ffn_gate_inp.weight", state[f + "router.weight"])
        gate, up = state[f + "experts.gate_up_proj"].transpose(1, 2).split(inter, dim=1)
        add(b + "ffn_gate_exps.weight", gate, True)
        add(b + "ffn_up_exps.weight", up, True)
        add(b + "ffn_down_exps.weight", state[f + "experts.down_proj"].transpose(1, 2), True)
        for x in ("gate", "up", "down"):
            add(b + f"ffn_{x}_shexp.weight", state[f + f"shared_expert.{x}_proj.weight"], True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama4_gguf") / "m"
    return l4.make_llama4(folder, rope_parameters=SCOUT_ROPE), folder


def test_gguf_gives_the_checkpoints_arch_and_logits(hf_model, tmp_path, monkeypatch):
    """The file's arch is the HF folder's (interleaved MoE layers, chunked and NoPE layers, the
    shared expert, Scout's RoPE scaling); hearth's logits over the file (whole prompt, then
    chunks and decodes over the cache, past two attention chunks) are transformers'."""
    from hearth.models.gguf_loader import GGUFCheckpoint

    monkeypatch.setattr(parity, "NUM_BLOCKS", 24)
    model, folder = hf_model
    path = write_llama4_gguf(tmp_path / "m.gguf", model)
    arch, want = GGUFCheckpoint(path).arch, HFCheckpoint(folder).arch
    assert arch.family_spec == want.family_spec
    assert arch.family_spec.rope_layers == (True, False, True, False)
    assert arch.moe == want.moe and arch.moe.dense_layers == (0, 2)
    assert arch.moe.num_shared_experts == 1
    for field in ("rope_scaling", "rope_theta", "intermediate_size", "head_dim", "num_kv_heads",
                  "attention_bias", "qk_norm", "tie_word_embeddings"):
        assert getattr(arch, field) == getattr(want, field), field
    logits = hf_logits(model, l4.PROMPT)
    assert logits.std() > 0.5
    run = GgufRun(path)
    chunked = [run.step(l4.PROMPT[:13]), run.step(l4.PROMPT[13:60])]
    chunked += [run.step([token]) for token in l4.PROMPT[60:]]
    for got in (GgufRun(path).step(l4.PROMPT), torch.cat(chunked)):
        torch.testing.assert_close(got, logits, atol=parity.ATOL, rtol=0)


def test_defaults_are_llama_cpps(tmp_path):
    """A file without the chunk / pattern / temperature keys (as llama.cpp writes Scout) is a
    checkpoint with Scout's settings: 8192-token chunks, every 4th layer NoPE, floor 8192,
    scale 0.1."""
    from hearth.models.gguf_loader import GGUFCheckpoint

    scout = dict(attention_chunk_size=8192, no_rope_layer_interval=4, floor_scale=8192,
                 attn_scale=0.1, rope_parameters=SCOUT_ROPE, num_hidden_layers=8)
    model = l4.make_llama4(tmp_path / "m", **scout)
    path = write_llama4_gguf(tmp_path / "m.gguf", model, settings=False)
    spec = GGUFCheckpoint(path).arch.family_spec
    assert spec == HFCheckpoint(tmp_path / "m").arch.family_spec
    assert spec.rope_layers == (True, True, True, False) * 2


def test_engine_greedy_tokens_equal_transformers(hf_model, tmp_path):
    """Through the engine (chunked prefill across the attention chunks, prefix hits on the
    second round): transformers' greedy tokens and logprobs."""
    model, _ = hf_model
    path = write_llama4_gguf(tmp_path / "m.gguf", model)
    prompts = l4.PROMPTS[:4]
    check_engine_greedy(path, model, prompts, l4.GREEDY, **l4.EXACT, quantization="none", max_num_batched_tokens=16)


def test_q8_0_file_under_quantization_gguf(hf_model, tmp_path, monkeypatch):
    """`gguf` (what `auto` picks for a GGUF): NoPE layers' QKV and every o_proj multiply in the
    file's Q8_0 blocks, as do the dense MLPs, the shared experts and the routed expert stacks;
    a RoPE layer's QKV, whose rows the loader permutes, is quantized from its float weights
    instead (the file's rows are in the interleaved order). Logits as the float model of the
    same file, and near transformers' float model."""
    from hearth.engine.executor import build_model_for
    from hearth.engine.llm import make_engine_config
    from hearth.models.gguf_loader import GGUFCheckpoint
    from hearth.ops.cpu_kernels import load_cpu_kernels

    if load_cpu_kernels() is None:
        pytest.skip("hearth's CPU kernels are not built here")
    monkeypatch.setattr(parity, "NUM_BLOCKS", 24)
    model, _ = hf_model
    path = write_llama4_gguf(tmp_path / "q.gguf", model, gguf.GGMLQuantizationType.Q8_0)
    checkpoint = GGUFCheckpoint(path)

    def build(quantization: str):
        config = make_engine_config(str(path), quantization=quantization, **l4.EXACT)
        return build_model_for(config, checkpoint).model

    served = build("gguf")
    rope, nope = served.layers[0].self_attn, served.layers[1].self_attn
    assert rope.use_rope and not nope.use_rope
    assert nope.qkv_proj.blocks_only and rope.o_proj.blocks_only
    assert not rope.qkv_proj.blocks_only
    assert rope.qkv_proj.qweight.qtype == gguf.GGMLQuantizationType.Q8_0.value
    dense, moe = served.layers[0].mlp, served.layers[1].mlp
    assert dense.gate_up_proj.blocks_only and moe.shared_experts.down_proj.blocks_only
    assert moe.experts.blocks_only
    got = GgufRun(path, served).step(l4.PROMPT)
    torch.testing.assert_close(got, GgufRun(path, build("none")).step(l4.PROMPT), atol=1e-3,
                               rtol=0)
    want = hf_logits(model, l4.PROMPT)
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


def test_a_truncated_or_incomplete_file_is_refused_naming_the_tensor(hf_model, tmp_path):
    from hearth.models.gguf_loader import GGUFCheckpoint

    model, _ = hf_model
    path = write_llama4_gguf(tmp_path / "m.gguf", model)
    tensors = GGUFCheckpoint(path).file.tensors
    last = max(tensors, key=lambda n: tensors[n].offset)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:-64])
    with pytest.raises(ValueError, match=rf"{last}.*truncated"):
        GGUFCheckpoint(cut)
    for dropped, match in (("blk.1.ffn_down_exps.weight",
                            r"model\.layers\.1\.feed_forward\.experts\.down_proj"),
                           ("blk.3.ffn_up_shexp.weight",
                            r"model\.layers\.3\.feed_forward\.shared_expert\.up_proj")):
        write_llama4_gguf(tmp_path / "d.gguf", model, drop_tensors=(dropped,))
        with pytest.raises((ValueError, KeyError), match=match):
            LLM(str(tmp_path / "d.gguf"), **l4.EXACT, quantization="none")


def test_a_pattern_array_is_read_and_bad_metadata_refused(hf_model, tmp_path):
    """A per-layer sliding_window_pattern array gives the same layers as the interval; a
    missing interleave_moe_layer_step or a short array is refused naming the key."""
    from hearth.models.gguf_loader import GGUFCheckpoint

    model, folder = hf_model
    path = write_llama4_gguf(tmp_path / "a.gguf", model, pattern=[True, False, True, False])
    assert GGUFCheckpoint(path).arch.family_spec == HFCheckpoint(folder).arch.family_spec
    for name, kwargs, match in (
            ("step", dict(drop_keys=("interleave_moe_layer_step",)),
             r"no llama4\.interleave_moe_layer_step"),
            ("short", dict(pattern=[True, False]),
             r"sliding_window_pattern has 2 entries for 4 layers")):
        path = write_llama4_gguf(tmp_path / f"{name}.gguf", model, **kwargs)
        with pytest.raises(ValueError, match=match):
            GGUFCheckpoint(path)

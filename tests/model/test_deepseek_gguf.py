"""DeepSeek-V2/V3 (Kimi K2) as llama.cpp's `deepseek2` GGUF: the same weights as the HF folder
give the same model, whichever form the converter wrote kv_b_proj in.

The files are written here as llama.cpp's convert_hf_to_gguf.py (DeepseekV2Model) writes them:
rotary rows left interleaved, experts stacked into ffn_{gate,up,down}_exps [E, I, H] /
[E, H, I], the router's correction bias as exp_probs_b, shared experts as ffn_*_shexp, and
kv_b_proj either whole (attn_kv_b, older files: head_count_kv = heads, key/value_length the
per-head widths) or split per head into attn_k_b [H, kv_lora_rank, nope] (transposed) and
attn_v_b [H, v, kv_lora_rank] (newer files: head_count_kv 1, key/value_length of the latent,
key/value_length_mla the per-head widths).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hearth.engine.llm import LLM
from hearth.models.hf_loader import HFCheckpoint
from hearth.models.random_checkpoint import write_random_deepseek
from hearth.ops.attention import build_attention_metadata
from tests.model.test_moe import EXACT, GREEDY, PROMPTS

gguf = pytest.importorskip("gguf")

YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
        "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}


def write_deepseek_gguf(path: Path, folder: Path, split_kv_b: bool, qtype=None, attn_qtype=None,
                        drop_keys: tuple[str, ...] = (),
                        drop_tensors: tuple[str, ...] = ()) -> Path:
    """The HF DeepSeek folder as llama.cpp converts it (module docstring); the MLP and expert
    projections and output head in `qtype` (a gguf.GGMLQuantizationType; None: F32), the
    attention projections in `attn_qtype` (default: `qtype`), except attn_k_b, whose rows
    (nope = 16 values) are shorter than a block."""
    import numpy as np
    from gguf.quants import quantize as reference_quantize

    config = json.loads((folder / "config.json").read_text())
    weights = load_file(str(folder / "model.safetensors"))
    heads, layers = config["num_attention_heads"], config["num_hidden_layers"]
    nope, rope, v_dim = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
    kv_lora, num_experts = config["kv_lora_rank"], config["n_routed_experts"]
    arch = "deepseek2"
    writer = gguf.GGUFWriter(str(path), arch)
    keys = {
        "block_count": layers, "context_length": config["max_position_embeddings"],
        "embedding_length": config["hidden_size"],
        "feed_forward_length": config["intermediate_size"],
        "attention.head_count": heads,
        "leading_dense_block_count": config["first_k_dense_replace"],
        "attention.q_lora_rank": config["q_lora_rank"], "attention.kv_lora_rank": kv_lora,
        "expert_feed_forward_length": config["moe_intermediate_size"],
        "expert_count": num_experts, "expert_used_count": config["num_experts_per_tok"],
        "expert_shared_count": config["n_shared_experts"],
        "expert_group_count": config["n_group"], "expert_group_used_count": config["topk_group"],
        "expert_gating_func": 2 if config["scoring_func"] == "sigmoid" else 1,
        "rope.dimension_count": rope,
    }
    if split_kv_b:  # MQA over the latent, the per-head widths in *_mla
        keys.update({"attention.head_count_kv": 1, "attention.key_length": kv_lora + rope,
                     "attention.value_length": kv_lora, "attention.key_length_mla": nope + rope,
                     "attention.value_length_mla": v_dim})
    else:
        keys.update({"attention.head_count_kv": heads, "attention.key_length": nope + rope,
                     "attention.value_length": v_dim})
    for key, value in keys.items():
        if key not in drop_keys:
            writer.add_uint32(f"{arch}.{key}", value)
    floats = {"attention.layer_norm_rms_epsilon": config["rms_norm_eps"],
              "rope.freq_base": config["rope_theta"],
              "expert_weights_scale": config["routed_scaling_factor"]}
    scaling = config.get("rope_scaling")
    if scaling:
        writer.add_string(f"{arch}.rope.scaling.type", "yarn")
        writer.add_uint32(f"{arch}.rope.scaling.original_context_length",
                          scaling["original_max_position_embeddings"])
        floats.update({"rope.scaling.factor": scaling["factor"],
                       "rope.scaling.yarn_log_multiplier": 0.1 * scaling["mscale_all_dim"]})
    for key, value in floats.items():
        if key not in drop_keys:
            writer.add_float32(f"{arch}.{key}", value)
    if config["norm_topk_prob"]:
        writer.add_bool(f"{arch}.expert_weights_norm", True)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([chr(ord("a") + i % 26) * (1 + i // 26)
                           for i in range(config["vocab_size"])])
    writer.add_token_merges(["a a"])  # the writer drops an empty list

    def add(name: str, tensor: torch.Tensor, quantize: bool = False) -> None:
        if name in drop_tensors:
            return
        data = np.ascontiguousarray(tensor.float().numpy())
        kind = (attn_qtype or qtype) if ".attn_" in name else qtype
        if quantize and kind is not None:
            data = reference_quantize(data, kind)
            writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=kind)
        else:
            writer.add_tensor(name, data)

    add("token_embd.weight", weights["model.embed_tokens.weight"])
    add("output_norm.weight", weights["model.norm.weight"])
    add("output.weight", weights["lm_head.weight"], True)
    for i in range(layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        for hf, gg in (("input_layernorm", "attn_norm"), ("post_attention_layernorm", "ffn_norm"),
                       ("self_attn.q_a_proj", "attn_q_a"),
                       ("self_attn.q_a_layernorm", "attn_q_a_norm"),
                       ("self_attn.q_b_proj", "attn_q_b"),
                       ("self_attn.kv_a_proj_with_mqa", "attn_kv_a_mqa"),
                       ("self_attn.kv_a_layernorm", "attn_kv_a_norm"),
                       ("self_attn.o_proj", "attn_output"), ("mlp.gate", "ffn_gate_inp"),
                       ("mlp.gate_proj", "ffn_gate"), ("mlp.up_proj", "ffn_up"),
                       ("mlp.down_proj", "ffn_down"),
                       ("mlp.shared_experts.gate_proj", "ffn_gate_shexp"),
                       ("mlp.shared_experts.up_proj", "ffn_up_shexp"),
                       ("mlp.shared_experts.down_proj", "ffn_down_shexp")):
            if p + hf + ".weight" in weights:
                add(b + gg + ".weight", weights[p + hf + ".weight"],
                    hf.endswith(("_proj", "_mqa")))
        if p + "mlp.gate.e_score_correction_bias" in weights:
            add(b + "exp_probs_b.bias", weights[p + "mlp.gate.e_score_correction_bias"])
        kv_b = weights[p + "self_attn.kv_b_proj.weight"]
        if split_kv_b:
            per_head = kv_b.view(heads, nope + v_dim, kv_lora)
            add(b + "attn_k_b.weight", per_head[:, :nope].transpose(1, 2))  # [H, L, nope]
            add(b + "attn_v_b.weight", per_head[:, nope:], True)  # [H, v, L]
        else:
            add(b + "attn_kv_b.weight", kv_b, True)
        if p + "mlp.experts.0.gate_proj.weight" in weights:
            for x in ("gate", "up", "down"):
                add(b + f"ffn_{x}_exps.weight",
                    torch.stack([weights[p + f"mlp.experts.{j}.{x}_proj.weight"]
                                 for j in range(num_experts)]), True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def prompt_then_decode_logits(model, tokens: list[int], num_prompt: int) -> torch.Tensor:
    """Logits of every position: the first `num_prompt` tokens as one prompt step (MLA's
    up-projected path), then one token per step (the absorbed path) over the latent cache."""
    planes, heads, dim = model.arch.kv_cache_layout()
    cache = torch.zeros(len(model.layers), planes, 8, 16, heads, dim)
    table = [list(range(8))]
    out = []
    with torch.inference_mode():
        meta = build_attention_metadata([num_prompt], [num_prompt], table, 16)
        hidden, _ = model(torch.tensor(tokens[:num_prompt]), torch.arange(num_prompt), meta, cache)
        out.append(model.compute_logits(hidden))
        for i in range(num_prompt, len(tokens)):
            meta = build_attention_metadata([1], [i + 1], table, 16)
            hidden, _ = model(torch.tensor([tokens[i]]), torch.tensor([i]), meta, cache)
            out.append(model.compute_logits(hidden))
    return torch.cat(out)


def build(source: str, checkpoint, quantization: str = "none"):
    from hearth.engine.executor import build_model_for
    from hearth.engine.llm import make_engine_config

    return build_model_for(make_engine_config(source, quantization=quantization, **EXACT),
                           checkpoint).model


@pytest.mark.parametrize("version,split_kv_b,rope_scaling", [
    ("deepseek_v3", False, None), ("deepseek_v3", True, YARN), ("deepseek_v2", True, None),
], ids=["v3-kv_b", "v3-k_b-v_b-yarn", "v2-k_b-v_b"])
def test_gguf_deepseek_equals_the_hf_folder(tmp_path: Path, version, split_kv_b, rope_scaling):
    """The GGUF gives the HF folder's MLA and MoE settings and, prompt and decode steps alike,
    its logits."""
    from hearth.models.gguf_loader import GGUFCheckpoint

    folder = write_random_deepseek(tmp_path / "m", architecture=version,
                                   rope_scaling=rope_scaling)
    hf_checkpoint = HFCheckpoint(folder)
    checkpoint = GGUFCheckpoint(write_deepseek_gguf(tmp_path / "m.gguf", folder, split_kv_b))
    arch, want = checkpoint.arch, hf_checkpoint.arch
    assert arch.architecture == version
    assert (arch.mla, arch.moe) == (want.mla, want.moe)
    assert (arch.num_kv_heads, arch.head_dim) == (want.num_kv_heads, want.head_dim)
    if rope_scaling:
        assert arch.rope_scaling["mscale_all_dim"] == pytest.approx(1.0)
    torch.testing.assert_close(checkpoint.get("model.layers.1.self_attn.kv_b_proj.weight"),
                               hf_checkpoint.get("model.layers.1.self_attn.kv_b_proj.weight"),
                               atol=0, rtol=0)
    tokens = PROMPTS[5][:40]
    got = prompt_then_decode_logits(build(str(tmp_path / "m.gguf"), checkpoint), tokens, 24)
    want_logits = prompt_then_decode_logits(build(str(folder), hf_checkpoint), tokens, 24)
    torch.testing.assert_close(got, want_logits, atol=1e-4, rtol=0)


def test_gguf_serves_greedy_as_the_hf_folder(tmp_path: Path):
    """Through the whole engine (chunked prompts, the GGUF's own tokenizer metadata): the same
    greedy tokens as the HF folder."""
    folder = write_random_deepseek(tmp_path / "m")
    path = write_deepseek_gguf(tmp_path / "m.gguf", folder, split_kv_b=True)
    outs = []
    for source in (str(folder), str(path)):
        # quantization none: "auto" would requantize a float GGUF's linears to Q8_0
        llm = LLM(source, **EXACT, quantization="none", max_num_batched_tokens=32)
        try:
            outs.append([c.token_ids for c in llm.generate(PROMPTS[:4], GREEDY)])
            assert llm.engine.kv_pool_is_whole()
        finally:
            llm.engine.close()
    assert outs[1] == outs[0]


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_quantized_gguf_experts_serve_in_the_files_blocks(tmp_path: Path, qtype):
    """A Q8_0 (Q4_0) file: with quantization gguf the routed and shared experts multiply in the
    file's own blocks (Q4_0 stays Q4_0, not requantized to Q8_0), equal to the float model of
    the same file up to summation order; Q8_0 picks the F32 model's top token. The MLA
    projections are requantized to Q8_0 from the float weights, which is exact only for Q8_0
    values: the attention is Q8_0 in both files, as llama.cpp's mixed recipes keep it."""
    from hearth.models.gguf_loader import GGUFCheckpoint
    from hearth.ops.cpu_kernels import load_cpu_kernels

    if load_cpu_kernels() is None:
        pytest.skip("hearth's CPU kernels are not built here")
    ggml_type = gguf.GGMLQuantizationType[qtype]
    folder = write_random_deepseek(tmp_path / "m")
    path = write_deepseek_gguf(tmp_path / "q.gguf", folder, split_kv_b=True, qtype=ggml_type,
                               attn_qtype=gguf.GGMLQuantizationType.Q8_0)
    checkpoint = GGUFCheckpoint(path)
    served = build(str(path), checkpoint, "gguf")
    float_only = build(str(path), checkpoint)
    moe = served.layers[1].mlp
    assert moe.experts.qw13.qtype == moe.experts.qw2.qtype == ggml_type.value
    assert moe.experts.qw13.out_features == 8 * 2 * 32
    assert moe.shared_experts.gate_up_proj.qweight.qtype == ggml_type.value
    tokens = PROMPTS[5][:40]
    got = prompt_then_decode_logits(served, tokens, 8)
    torch.testing.assert_close(got, prompt_then_decode_logits(float_only, tokens, 8),
                               atol=1e-3, rtol=0)
    if qtype == "Q8_0":
        exact = prompt_then_decode_logits(build(str(folder), HFCheckpoint(folder)), tokens, 8)
        assert (got.argmax(-1) == exact.argmax(-1)).float().mean() >= 0.9


@pytest.mark.parametrize("drop_keys,drop_tensors,split_kv_b,match", [
    (("attention.kv_lora_rank",), (), True, "deepseek2.attention.kv_lora_rank"),
    (("expert_shared_count",), (), True, "deepseek2.expert_shared_count"),
    (("attention.q_lora_rank",), (), False, "deepseek2.attention.q_lora_rank"),
    ((), ("blk.1.attn_v_b.weight",), True, "blk.1.attn_v_b.weight"),
    ((), ("blk.2.attn_kv_a_norm.weight",), False, "layers.2.self_attn.kv_a_layernorm"),
    ((), ("blk.1.ffn_up_exps.weight",), True, "layers.1.mlp.experts.up_proj"),
], ids=["kv_lora_rank", "expert_shared_count", "q_lora_rank", "attn_v_b", "attn_kv_a_norm",
        "ffn_up_exps"])
def test_a_gguf_missing_a_key_or_tensor_fails_at_load_naming_it(tmp_path: Path, drop_keys,
                                                                drop_tensors, split_kv_b, match):
    folder = write_random_deepseek(tmp_path / "m")
    path = write_deepseek_gguf(tmp_path / "m.gguf", folder, split_kv_b, drop_keys=drop_keys,
                               drop_tensors=drop_tensors)
    with pytest.raises((ValueError, KeyError), match=match):
        LLM(str(path), **EXACT)

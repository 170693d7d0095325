"""gpt-oss (tiny) against transformers' own GptOssForCausalLM.

The checkpoint is built by transformers from a GptOssConfig (no hub) with every feature where it
matters: 3 layers (sliding, full, full) with a 12-token window (shorter than the prompts, not
a multiple of any cache block), learned sinks per head, q/k/v/o biases, YaRN RoPE, a MoE in
every layer (4 biased experts, top 2, a biased router) whose SwiGLU limit is low enough that the
clamps cut. Compared: the model's logits over a paged cache (whole prompt, chunks over a cached
prefix, decodes; torch and hearth's CPU kernels), each of sinks, windows and clamps shown to
change them, the engine's greedy tokens and logprobs in the exact formats through chunked
prefill and prefix-cache hits and under tensor and expert parallelism, and a folder whose
experts are MXFP4 blocks as OpenAI releases them.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import tests.model.test_hf_parity as parity
from hearth.engine.llm import LLM
from hearth.engine.sampling_params import SamplingParams
from hearth.models.families.gpt_oss.arch_fields import hf_fields
from hearth.models.families.gpt_oss.loading import FP4_VALUES
from hearth.models.hf_loader import HFCheckpoint
from hearth.models.random_checkpoint import _write_word_tokenizer
from hearth.ops.attention import AttentionSpec
from tests.model.test_hf_parity import PagedRun, check_engine_greedy, hf_greedy, hf_logits, randomize

transformers = pytest.importorskip("transformers")

WINDOW = 12
LIMIT = 1.5  # randomize's activations are O(1): a limit of 7 would never cut
SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=128, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
             num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
             swiglu_limit=LIMIT,
             # not transformers' default alternation: pipeline stage 2 (layer 2) then differs
             # from the model's layer 0, so a stage reading its local index would be caught
             layer_types=["sliding_attention", "full_attention", "full_attention"],
             rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                              "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                              "original_max_position_embeddings": 32})
PROMPT = [(11 * i + 5) % 250 + 3 for i in range(75)]  # six windows long
PROMPTS = [[(7 * i + 3 * j) % 250 + 3 for j in range(n)]
           for i, n in enumerate([5, 23, 34, 47, 70])]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
EXACT = dict(dtype="float32", prefill_dtype="float32", kv_cache_dtype="model")


def make_gpt_oss(folder: Path, seed: int = 4, **overrides):
    config = transformers.GptOssConfig(**{**SHAPE, **overrides})
    model = transformers.GptOssForCausalLM(config).to(torch.float32)
    randomize(model, seed)
    model.eval()
    model.save_pretrained(folder)
    _write_word_tokenizer(folder / "tokenizer.json", 256)
    return model


@pytest.fixture(scope="module")
def hf_gpt_oss(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt_oss") / "m"
    return make_gpt_oss(folder), folder


@pytest.fixture
def long_cache(monkeypatch):
    monkeypatch.setattr(parity, "NUM_BLOCKS", 24)  # 96 tokens of 4-token blocks


def paged_logits(folder: Path, kernels=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(the whole prompt in one step, the prompt in chunks over a cached prefix then decodes)."""
    whole = PagedRun(folder, kernels).step(PROMPT)
    run = PagedRun(folder, kernels)
    chunked = [run.step(PROMPT[:13]), run.step(PROMPT[13:60])]
    chunked += [run.step([token]) for token in PROMPT[60:]]
    return whole, torch.cat(chunked)


def test_the_config_becomes_the_arch(hf_gpt_oss):
    _, folder = hf_gpt_oss
    arch = HFCheckpoint(folder).arch
    spec = arch.family_spec
    assert arch.architecture == "gpt_oss"
    assert arch.attention_bias and arch.attention_out_bias and not arch.qk_norm
    assert spec.sliding_layers == (True, False, False) and spec.sliding_window == WINDOW
    assert (spec.swiglu_alpha, spec.swiglu_limit) == (1.702, LIMIT)
    moe = arch.moe
    assert (moe.num_experts, moe.num_experts_per_tok, moe.expert_intermediate_size,
            moe.dense_layers) == (4, 2, 32, ())
    assert arch.rope_scaling["rope_type"] == "yarn" and arch.rope_theta == 150000.0
    assert arch.rope_scaling["truncate"] is False
    # without layer_types, transformers' default: sliding on even layers
    config = {k: v for k, v in json.loads((folder / "config.json").read_text()).items()
              if k != "layer_types"}
    assert hf_fields(config, "gpt_oss", folder)["family_spec"].sliding_layers == (
        True, False, True)
    with pytest.raises(ValueError, match="sliding_attention layers need a sliding_window"):
        hf_fields({**config, "sliding_window": None}, "gpt_oss", folder)


def test_bad_layer_types_are_refused(tmp_path):
    make_gpt_oss(tmp_path / "m", layer_types=["sliding_attention", "full_attention",
                                              "chunked_attention"])
    with pytest.raises(ValueError, match=r"unknown layer_types \['chunked_attention'\]"):
        HFCheckpoint(tmp_path / "m")


@pytest.mark.parametrize("use_kernels", [False, True], ids=["torch", "kernels"])
def test_logits_equal_transformers(hf_gpt_oss, long_cache, use_kernels):
    model, folder = hf_gpt_oss
    kernels = None
    if use_kernels:
        from hearth.ops.cpu_kernels import load_cpu_kernels
        kernels = load_cpu_kernels("auto")
        if kernels is None:
            pytest.skip("hearth's CPU kernels are not built here")
    want = hf_logits(model, PROMPT)
    assert want.std() > 0.5
    for got in paged_logits(folder, kernels):
        torch.testing.assert_close(got, want, atol=parity.ATOL, rtol=0)


def test_quantization_packs_the_experts_with_their_biases_and_clamps(hf_gpt_oss):
    """q8_0 packs attention, the head and the experts; few-row steps run the packed experts
    through the kernel with gpt-oss's biases and clamped SwiGLU (transformers' logits up to
    Q8_0's rounding), many-row steps the float experts (exactly)."""
    from hearth.models.quant import quantize_model
    from hearth.models.weights import build_model
    from hearth.ops.cpu_kernels import load_cpu_kernels

    kernels = load_cpu_kernels("auto")
    if kernels is None:
        pytest.skip("hearth's CPU kernels are not built here")
    model, folder = hf_gpt_oss
    checkpoint = HFCheckpoint(folder)
    hearth_model = build_model(checkpoint, torch.float32)
    hearth_model.use_kernels(kernels)
    counts = quantize_model(hearth_model, checkpoint, "q8_0", kernels)
    assert counts == {"q8_0": 2 * 3 + 1, "experts-q8_0": 3}  # qkv and o per layer, the head
    assert all(layer.mlp.experts.qw13 is not None for layer in hearth_model.layers)
    run = PagedRun(folder, kernels)
    run.model = hearth_model
    prompt = PROMPT[:8]  # one few-row step: the packed experts
    want = hf_logits(model, prompt)
    got = run.step(prompt)
    assert (got - want).abs().max() < 0.05 * want.abs().max()
    unclamped = PagedRun(folder, kernels)
    unclamped.model = hearth_model
    for layer in hearth_model.layers:
        layer.mlp.experts.limit = 1e9
    assert (unclamped.step(prompt) - want).abs().max() > 0.1 * want.abs().max()


def test_sinks_windows_and_clamps_each_change_the_logits(hf_gpt_oss, long_cache):
    """The parity above holds only with each of them: without the sinks, without the windows,
    or with a limit that never cuts, the same weights give logits transformers does not."""
    model, folder = hf_gpt_oss
    want = hf_logits(model, PROMPT)

    def drift(change) -> float:
        run = PagedRun(folder)
        for layer in run.model.layers:
            change(layer)
        return float((run.step(PROMPT) - want).abs().max())

    assert drift(lambda layer: None) < parity.ATOL
    no_sinks = lambda layer: setattr(layer.self_attn, "spec",  # noqa: E731
                                     replace(layer.self_attn.spec, sinks=None))
    no_window = lambda layer: setattr(layer.self_attn, "spec",  # noqa: E731
                                      replace(layer.self_attn.spec, window=None))
    no_clamp = lambda layer: setattr(layer.mlp.experts, "limit", 1e9)  # noqa: E731
    for change in (no_sinks, no_window, no_clamp):
        assert drift(change) > 100 * parity.ATOL


def test_engine_greedy_tokens_and_logprobs_equal_transformers(hf_gpt_oss):
    """Chunked prefill (16-token steps, so chunks cross the windows' edges) and, on the second
    round, prefix-cache hits."""
    model, folder = hf_gpt_oss
    check_engine_greedy(folder, model, PROMPTS, GREEDY, **EXACT, max_num_batched_tokens=16)


@pytest.mark.parametrize("parallel", [dict(tensor_parallel_size=2),
                                      dict(tensor_parallel_size=2, enable_expert_parallel=True),
                                      dict(pipeline_parallel_size=2)],
                         ids=["tp2", "ep2", "pp2"])
def test_tensor_expert_and_pipeline_parallel_equal_one_process(hf_gpt_oss, parallel):
    """TP cuts heads (and their sinks) and each expert's width (the down bias added once); EP
    puts 2 whole experts, biases and all, on each rank; PP's second stage holds layer 2 only,
    a full layer by its index in the whole model (layer 0 of the model is sliding)."""
    _, folder = hf_gpt_oss
    runs = []
    for settings in ({}, parallel):
        llm = LLM(str(folder), **EXACT, **settings, max_num_batched_tokens=16)
        try:
            runs.append(llm.generate(PROMPTS, GREEDY))
            assert llm.engine.kv_pool_is_whole()
        finally:
            llm.engine.close()
    for want, got in zip(*runs):
        assert got.token_ids == want.token_ids
        assert [lp.logprob for lp in got.logprobs] == pytest.approx(
            [lp.logprob for lp in want.logprobs], abs=1e-4)


def to_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, out, in] float -> (blocks [E, out, in/32, 16] uint8, scales [E, out, in/32] uint8):
    each 32 values scaled by a power of two so the largest fits 6, rounded to the nearest
    e2m1 value, two nibbles a byte (low first)."""
    groups = weight.reshape(*weight.shape[:-1], -1, 32)
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp_min(1e-30) / 6.0))
    scaled = groups / torch.exp2(exponent)[..., None]
    lut = torch.tensor(FP4_VALUES)
    codes = (scaled[..., None] - lut).abs().argmin(-1).to(torch.uint8)  # [..., G, 32]
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponent + 127).to(torch.uint8)


def test_mxfp4_experts_load_as_transformers_dequantizes_them(hf_gpt_oss, tmp_path, long_cache):
    """A folder storing the experts as `*_blocks` + `*_scales`, its config in the older form
    (as OpenAI releases gpt-oss): the experts stay in those blocks (repacked, no float copy),
    and hearth's logits, on torch (the blocks decoded per step) and on the kernels' MXFP4
    tiles, equal transformers' model holding transformers' own dequantization of the same
    blocks (integrations.mxfp4.convert_moe_packed_tensors)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    model, folder = hf_gpt_oss
    out = tmp_path / "mxfp4"
    out.mkdir()
    weights = load_file(str(folder / "model.safetensors"))
    state = model.state_dict()
    for i in range(SHAPE["num_hidden_layers"]):
        for part in ("gate_up_proj", "down_proj"):
            name = f"model.layers.{i}.mlp.experts.{part}"
            blocks, scales = to_mxfp4(weights.pop(name).transpose(1, 2))  # rows: out features
            weights[name + "_blocks"], weights[name + "_scales"] = blocks, scales
            state[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    save_file(weights, str(out / "model.safetensors"))
    # the config as OpenAI's folders write it: rope_scaling and rope_theta (transformers 4),
    # experts_per_token, the quantization config (hearth reads the tensors' names instead)
    config = json.loads((folder / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config.update(rope_theta=rope.pop("rope_theta"), rope_scaling=rope,
                  experts_per_token=config.pop("num_experts_per_tok"),
                  quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": [
                      "model.layers.*.self_attn", "model.layers.*.mlp.router",
                      "model.embed_tokens", "lm_head"]})
    (out / "config.json").write_text(json.dumps(config))
    (out / "tokenizer.json").write_bytes((folder / "tokenizer.json").read_bytes())
    assert HFCheckpoint(out).arch == HFCheckpoint(folder).arch
    assert HFCheckpoint(out).arch.rope_scaling == HFCheckpoint(folder).arch.rope_scaling
    quantized = transformers.GptOssForCausalLM(model.config).to(torch.float32).eval()
    quantized.load_state_dict(state)
    gate_up = "model.layers.0.mlp.experts.gate_up_proj"
    assert not torch.equal(state[gate_up], model.state_dict()[gate_up])  # the blocks round
    want = hf_logits(quantized, PROMPT)
    from hearth.ops.cpu_kernels import MXFP4, load_cpu_kernels
    kernels = load_cpu_kernels("auto")
    for run in (PagedRun(out), *([PagedRun(out, kernels)] if kernels else [])):
        for layer in run.model.layers:  # the blocks are the only copy of the experts
            experts = layer.mlp.experts
            assert experts.blocks_only and experts.w13.is_meta and experts.w2.is_meta
            assert experts.qw13.qtype == experts.qw2.qtype == MXFP4
            assert experts.qw13.qs.numel() == experts.w13.numel() // 2  # 4 bits + an exponent
        # the prompt in one step, then decodes (few-row steps: the kernel's packed tiles)
        got = torch.cat([run.step(PROMPT[:60]), *[run.step([t]) for t in PROMPT[60:]]])
        torch.testing.assert_close(got, want, atol=parity.ATOL, rtol=0)
    # the engine on the blocks: greedy tokens and logprobs as transformers' (chunked prefill)
    llm = LLM(str(out), **EXACT, max_num_batched_tokens=16)
    try:
        completions = llm.generate(PROMPTS[:2], GREEDY)
        assert llm.engine.kv_pool_is_whole()
    finally:
        llm.engine.close()
    for completion, prompt in zip(completions, PROMPTS[:2]):
        tokens, logprobs = hf_greedy(quantized, prompt, GREEDY.max_tokens)
        assert completion.token_ids == tokens
        assert [lp.logprob for lp in completion.logprobs] == pytest.approx(logprobs, abs=1e-4)

    weights.pop("model.layers.1.mlp.experts.down_proj_scales")
    save_file(weights, str(out / "model.safetensors"))
    from hearth.models.weights import build_model
    down = r"model.layers.1.mlp.experts.down_proj"
    with pytest.raises(ValueError, match=rf"no tensor {down} \(nor MXFP4 {down}_blocks"):
        build_model(HFCheckpoint(out), torch.float32)

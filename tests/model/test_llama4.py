"""Llama 4 (Scout / Maverick shapes, tiny) against transformers' own Llama4ForCausalLM.

The checkpoint is built by transformers from a Llama4TextConfig (no hub) with every feature
switched on at a size where it matters: 4 layers alternating a chunked RoPE layer with a dense
MLP and a NoPE layer (full attention, temperature tuning with floor_scale 8) with a MoE MLP
(4 experts, top 1 as Scout and Maverick, plus the shared expert), a chunk of 32 tokens (two
blocks of the engine's 16; shorter than the prompts), llama3 RoPE scaling, the weightless q/k
norm. Compared: the model's logits over a paged cache (whole prompt, chunks over a cached
prefix, decodes; torch and hearth's CPU kernels), and the engine's greedy tokens and logprobs in
the exact formats through chunked prefill and prefix-cache hits, and under tensor and expert
parallelism. A Llama4ForConditionalGeneration folder (text_config, `language_model.` weights
beside vision ones) serves the same model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import tests.model.test_hf_parity as parity
from hearth.engine.llm import LLM
from hearth.engine.sampling_params import SamplingParams
from hearth.models.hf_loader import HFCheckpoint
from hearth.models.random_checkpoint import _write_word_tokenizer
from tests.model.test_hf_parity import PagedRun, check_engine_greedy, hf_greedy, hf_logits, randomize

transformers = pytest.importorskip("transformers")

CHUNK = 32
SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=32, intermediate_size_mlp=96,
             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=128, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
             num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2,
             no_rope_layer_interval=2, attention_chunk_size=CHUNK, floor_scale=8,
             attn_scale=0.5, use_qk_norm=True, attn_temperature_tuning=True,
             rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 32})
PROMPT = [(11 * i + 5) % 250 + 3 for i in range(75)]  # past two chunks
PROMPTS = [[(7 * i + 3 * j) % 250 + 3 for j in range(n)]
           for i, n in enumerate([5, 23, 34, 47, 70])]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
EXACT = dict(dtype="float32", prefill_dtype="float32", kv_cache_dtype="model")


def make_llama4(folder: Path, seed: int = 4, **overrides):
    config = transformers.Llama4TextConfig(**{**SHAPE, **overrides})
    model = transformers.Llama4ForCausalLM(config).to(torch.float32)
    randomize(model, seed)
    model.eval()
    model.save_pretrained(folder)
    _write_word_tokenizer(folder / "tokenizer.json", 256)
    return model


@pytest.fixture(scope="module")
def hf_llama4(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama4") / "m"
    return make_llama4(folder), folder


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


def test_the_config_becomes_the_arch(hf_llama4):
    _, folder = hf_llama4
    arch = HFCheckpoint(folder).arch
    spec = arch.family_spec
    assert arch.architecture == "llama4" and arch.intermediate_size == 96
    assert spec.rope_layers == (True, False, True, False)
    assert spec.chunked_layers == (True, False, True, False)
    assert (spec.attention_chunk_size, spec.floor_scale, spec.attn_scale) == (CHUNK, 8.0, 0.5)
    moe = arch.moe
    assert (moe.num_experts, moe.num_experts_per_tok, moe.expert_intermediate_size,
            moe.num_shared_experts, moe.dense_layers) == (4, 1, 32, 1, (0, 2))
    assert arch.rope_scaling["rope_type"] == "llama3" and arch.rope_theta == 500000.0


@pytest.mark.parametrize("use_kernels", [False, True], ids=["torch", "kernels"])
def test_logits_equal_transformers(hf_llama4, long_cache, use_kernels):
    model, folder = hf_llama4
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


def test_top2_routing_and_explicit_layer_lists_equal_transformers(tmp_path, long_cache):
    """k > 1 (each pick's own scaled input), moe_layers and no_rope_layers given as lists
    (MoE on layers 0 and 3, NoPE on 1 and 2), no chunk on any layer."""
    model = make_llama4(tmp_path / "m", seed=5, num_experts_per_tok=2, moe_layers=[0, 3],
                        no_rope_layers=[1, 0, 0, 1], attention_chunk_size=None)
    arch = HFCheckpoint(tmp_path / "m").arch
    assert arch.moe.dense_layers == (1, 2) and not any(arch.family_spec.chunked_layers)
    want = hf_logits(model, PROMPT)
    for got in paged_logits(tmp_path / "m"):
        torch.testing.assert_close(got, want, atol=parity.ATOL, rtol=0)


def test_engine_greedy_tokens_and_logprobs_equal_transformers(hf_llama4):
    """Chunked prefill (16-token steps, so chunks cross the attention chunks' edges) and, on
    the second round, prefix-cache hits."""
    model, folder = hf_llama4
    check_engine_greedy(folder, model, PROMPTS, GREEDY, **EXACT, max_num_batched_tokens=16)


def test_a_conditional_generation_folder_serves_its_text_model(hf_llama4, tmp_path, long_cache):
    """Llama4ForConditionalGeneration: config under text_config, weights under
    `language_model.`, the vision tower and projector beside them (never read)."""
    model, folder = hf_llama4
    out = tmp_path / "vlm"
    out.mkdir()
    weights = {"language_model." + k: v for k, v in
               load_file(str(folder / "model.safetensors")).items()}
    weights["vision_model.patch_embedding.linear.weight"] = torch.ones(8, 8)
    weights["multi_modal_projector.linear_1.weight"] = torch.ones(64, 8)
    save_file(weights, str(out / "model.safetensors"))
    text = json.loads((folder / "config.json").read_text())
    config = {"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4",
              "text_config": {k: v for k, v in text.items() if k != "architectures"},
              "vision_config": {"hidden_size": 8}, "image_token_index": 200092}
    (out / "config.json").write_text(json.dumps(config))
    checkpoint = HFCheckpoint(out)
    assert checkpoint.arch == HFCheckpoint(folder).arch
    assert not [n for n in checkpoint.tensor_names() if "vision" in n or "projector" in n]
    want = hf_logits(model, PROMPT)
    torch.testing.assert_close(PagedRun(out).step(PROMPT), want, atol=parity.ATOL, rtol=0)

    # a stray tensor the text model has no place for is still refused
    weights["language_model.model.layers.0.feed_forward.extra.weight"] = torch.ones(2)
    save_file(weights, str(out / "model.safetensors"))
    from hearth.models.weights import build_model
    with pytest.raises(ValueError, match="no place for: model.layers.0.feed_forward.extra"):
        build_model(HFCheckpoint(out), torch.float32)


def test_a_chunk_that_is_not_whole_cache_blocks_is_refused_at_load(tmp_path):
    make_llama4(tmp_path / "m", attention_chunk_size=24)
    with pytest.raises(ValueError, match=r"attention_chunk_size=24 is not a multiple of the KV "
                                         r"cache block size 16"):
        LLM(str(tmp_path / "m"), **EXACT)
    HFCheckpoint(tmp_path / "m").arch.check_block_size(8)  # 8-token blocks serve it


@pytest.mark.parametrize("parallel", [dict(tensor_parallel_size=2),
                                      dict(tensor_parallel_size=2, enable_expert_parallel=True)],
                         ids=["tp2", "ep2"])
def test_tensor_and_expert_parallel_equal_one_process(hf_llama4, parallel):
    """TP cuts heads, the dense and shared MLPs and each expert's width; EP puts 2 whole
    experts on each rank (the packed tensors sliced by expert)."""
    _, folder = hf_llama4
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

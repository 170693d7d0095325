"""DeepSeek-V3 / Kimi K2 (and V2) in the engine: multi-head latent attention over a latent paged
cache and DeepSeek's MoE, against transformers and against itself across parallel layouts.

The logits of the model alone are compared in tests/model/test_hf_parity.py (the deepseek
cases); here the whole engine runs: chunked prefill, prefix hits, preemption, speculative
drafts, tensor / expert / pipeline parallelism, and the fast default formats.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hearth.config import SpeculativeConfig
from hearth.engine.llm import LLM
from hearth.models.families.deepseek.model import FusedMLAModel
from hearth.models.hf_loader import HFCheckpoint
from hearth.models.random_checkpoint import _write_word_tokenizer, write_random_deepseek
from tests.model.test_hf_parity import make_hf_model
from tests.model.test_moe import EXACT, GREEDY, PROMPTS, hf_greedy

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_deepseek(tmp_path_factory):
    """A tiny DeepSeek-V3 from transformers (MLA 32 + 8, 8 experts in 4 groups, top 2 of the
    best 2 groups, a shared expert, a dense first layer), with a word-level tokenizer."""
    model, folder = make_hf_model(tmp_path_factory.mktemp("ds"), "deepseek-v3")
    _write_word_tokenizer(folder / "tokenizer.json", 256)
    return model, folder


def test_engine_greedy_equals_transformers_through_chunks_hits_preemption_and_drafts(hf_deepseek):
    model, folder = hf_deepseek
    prompts = PROMPTS[:5]  # the checkpoint's 64 positions hold the longest with its output
    want = [hf_greedy(model, p, GREEDY.max_tokens) for p in prompts]
    for settings in (dict(num_blocks=10, max_num_batched_tokens=32),  # chunks + preemption
                     dict(speculative=SpeculativeConfig(method="suffix"))):  # drafts
        llm = LLM(str(folder), **EXACT, **settings)
        try:
            first = llm.generate(prompts, GREEDY)
            second = llm.generate(prompts, GREEDY)  # prompts now hit the prefix cache
            assert llm.engine.kv_pool_is_whole()
            if "num_blocks" in settings:
                assert llm.engine.counters.preemptions > 0
            else:
                assert llm.engine.speculator.counters.num_accepted_tokens > 0
        finally:
            llm.engine.close()
        assert [c.token_ids for c in first] == want
        assert [c.token_ids for c in second] == want
        assert sum(c.cached_tokens for c in second) > 0


@pytest.fixture(scope="module")
def tiny_deepseek(tmp_path_factory) -> str:
    # 4 heads and 8 experts on 2 ranks: TP splits the heads (the latent is replicated) and
    # cuts the experts along their width; EP puts 4 whole experts on each rank.
    return str(write_random_deepseek(tmp_path_factory.mktemp("tiny-ds") / "m", num_layers=4))


def run_twice(llm: LLM):
    try:
        outs = llm.generate(PROMPTS, GREEDY) + llm.generate(PROMPTS, GREEDY)
        assert llm.engine.kv_pool_is_whole()
        return outs, llm.engine.counters.preemptions
    finally:
        llm.engine.close()


@pytest.mark.parametrize("parallel", [
    dict(tensor_parallel_size=2),
    dict(tensor_parallel_size=2, enable_expert_parallel=True),
    dict(tensor_parallel_size=2, pipeline_parallel_size=2, enable_expert_parallel=True),
], ids=["tp2", "ep2", "ep2-pp2"])
def test_tensor_and_expert_parallel_equal_one_process(tiny_deepseek, parallel):
    settings = dict(num_blocks=16, max_num_batched_tokens=32)
    want, want_preemptions = run_twice(LLM(tiny_deepseek, **settings))
    got, preemptions = run_twice(LLM(tiny_deepseek, **settings, **parallel))
    assert want_preemptions > 0 and preemptions == want_preemptions
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids
        assert (g.prompt_tokens, g.cached_tokens) == (w.prompt_tokens, w.cached_tokens)
        for a, b in zip(w.logprobs, g.logprobs):
            assert abs(a.logprob - b.logprob) < 1e-4


def test_the_cache_holds_one_latent_row_per_token(tiny_deepseek):
    """KV bytes per token: (kv_lora_rank + qk_rope_head_dim) values per layer, not K and V of
    every head: here 40 against 4 heads x (24 (k) + 16 (v)) = 160 of the expanded cache."""
    llm = LLM(tiny_deepseek, **EXACT, num_blocks=16)
    try:
        kv = llm.engine.executor.kv_cache
        arch = llm.engine.arch
        assert tuple(kv.shape[:2]) == (arch.num_layers, 1) and tuple(kv.shape[4:]) == (1, 40)
        per_token = kv[:, :, 0, 0].numel()
        expanded = arch.num_layers * arch.num_heads * (arch.mla.qk_head_dim + arch.mla.v_head_dim)
        assert per_token == arch.num_layers * 40 and expanded / per_token == 4.0
    finally:
        llm.engine.close()


def test_default_formats_agree_with_float32(tiny_deepseek):
    """The fast formats (Q8_0 projections and experts for decode steps, bf16 KV read by the
    kernels in place) pick the float32 model's top token almost always."""
    exact = LLM(tiny_deepseek, **EXACT)
    fast = LLM(tiny_deepseek, quantization="q8_0", kv_cache_dtype="bfloat16")
    try:
        params = GREEDY
        want = exact.generate(PROMPTS, params)
        got = fast.generate(PROMPTS, params)
        agree = total = 0
        for w, g in zip(want, got):
            # compare the first token only where the prompts are identical contexts
            agree += int(w.token_ids[0] == g.token_ids[0])
            total += 1
        assert agree >= total - 1
        assert fast.engine.kv_pool_is_whole()
        assert fast.engine.executor.kv_cache.dtype == torch.bfloat16
        attn = fast.engine.executor.model.layers[0].self_attn
        assert attn.qkv_a_proj.qweight is not None and attn.o_proj.qweight is not None
    finally:
        exact.engine.close()
        fast.engine.close()


def assert_same_outputs(got: list, want: list, tol: float) -> None:
    """Two runs' completions: the same tokens, each logprob within `tol`."""
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        for a, b in zip(g.logprobs, w.logprobs):
            assert abs(a.logprob - b.logprob) < tol


def test_fused_decode_layers_serve_the_fast_formats(tiny_deepseek):
    """Where the CPU kernels run, decode and speculative verify steps of the fast formats go
    through one `mla_decode_layers` call for all layers; tokens and logprobs equal the module
    path's (two engines from the same start: a second run in one engine would draft from the
    first run's outputs, and a verify row rounds differently from a decode row)."""
    runs = []
    for fused in (True, False):
        llm = LLM(tiny_deepseek, quantization="q8_0", kv_cache_dtype="bfloat16",
                  speculative=SpeculativeConfig(method="suffix"))
        try:
            model = llm.engine.executor.model
            if getattr(model.attn_backend, "kernels", None) is None:
                pytest.skip("no CPU kernel build is usable here")
            assert isinstance(model._fused_all, FusedMLAModel)
            if not fused:
                model._fused_all = None
            runs.append(llm.generate(PROMPTS + [PROMPTS[0] * 3], GREEDY))
            assert llm.engine.kv_pool_is_whole()
            assert llm.engine.speculator.counters.num_accepted_tokens > 0
        finally:
            llm.engine.close()
    assert_same_outputs(*runs, tol=1e-3)


def test_short_chunks_over_a_cached_prefix_attend_absorbed(tiny_deepseek, monkeypatch):
    """A prompt chunk of more than 16 tokens whose absorbed attention is cheaper than
    up-projecting its context (a later agent turn over a long cached prefix) attends as decode
    does; its tokens and logprobs equal the expanded path's (exact formats), and the pool is
    whole after both."""
    from hearth.models.families.deepseek.model import MLAAttention

    base = [(5 * j) % 200 + 3 for j in range(40)]
    turn = base + [(11 * j) % 200 + 7 for j in range(20)]  # a 20-token chunk after 40 cached
    calls: list[int] = []
    absorbed = MLAAttention._absorbed_chunk
    monkeypatch.setattr(MLAAttention, "_absorbed_chunk",
                        lambda self, qn, *a: calls.append(qn.shape[0]) or absorbed(self, qn, *a))
    runs = []
    for speedup in (1e9, 0.0):  # always absorbed where a chunk may be, then never
        monkeypatch.setattr(MLAAttention, "ABSORBED_SPEEDUP", speedup)
        llm = LLM(tiny_deepseek, **EXACT)
        try:
            llm.generate([base], GREEDY)
            calls.clear()
            out = llm.generate([turn], GREEDY)[0]
            assert out.cached_tokens == 32  # whole blocks of the 40-token prefix
            # the chunk after the cached blocks, in every layer (or in none)
            layers = len(llm.engine.executor.model.layers)
            assert calls == ([28] * layers if speedup > 1 else [])
            runs.append(out)
            assert llm.engine.kv_pool_is_whole()
        finally:
            llm.engine.close()
    assert_same_outputs([runs[0]], [runs[1]], tol=1e-4)


@pytest.mark.parametrize("n_shared", [1, 2])
def test_fused_layers_fold_one_shared_expert_into_the_routed_call(tmp_path: Path, n_shared):
    """One shared expert of the routed width (DeepSeek-V3, Kimi K2) runs inside the routed
    experts' calls of `mla_decode_layers` (its rows against every token's own row); two (a
    shared MLP twice as wide) keep their own dense MLP. Either way, with 8-bit activations, the
    tokens equal the module path's and the logprobs are within one activation rounding of
    them: the two paths sum in different orders (hidden rows ~1e-6 apart), and where a value
    sits at a rounding tie of its 8-bit block the two round it apart, one step of that block's
    scale (seen on a Zen 4 EPYC's VNNI build: one row 0.03 apart after 3 layers, logprobs 0.008
    with a float32 cache, 0.056 with bf16; every other step ~1e-6)."""
    folder = str(write_random_deepseek(tmp_path / "m", num_layers=3, n_shared_experts=n_shared))
    runs = []
    for fused in (True, False):
        llm = LLM(folder, quantization="q8_0-a8", kv_cache_dtype="bfloat16")
        try:
            model = llm.engine.executor.model
            if getattr(model.attn_backend, "kernels", None) is None:
                pytest.skip("no CPU kernel build is usable here")
            assert model._fused_all is not None
            if not fused:
                model._fused_all = None
            runs.append(llm.generate(PROMPTS[:4], GREEDY))
            assert llm.engine.kv_pool_is_whole()
        finally:
            llm.engine.close()
    assert_same_outputs(*runs, tol=0.1)


def test_broken_deepseek_checkpoints_fail_at_load_naming_the_problem(tmp_path: Path):
    from safetensors.torch import load_file, save_file

    folder = write_random_deepseek(tmp_path / "m")
    weights = load_file(str(folder / "model.safetensors"))
    del weights["model.layers.1.self_attn.kv_a_layernorm.weight"]
    save_file(weights, str(folder / "model.safetensors"))
    with pytest.raises(Exception, match="kv_a_layernorm"):
        LLM(str(folder), **EXACT)
    config = json.loads((folder / "config.json").read_text())
    config["n_group"] = 3  # does not divide 8 experts
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="n_group"):
        HFCheckpoint(folder)
    config.update(n_group=4, scoring_func="relu")
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="scoring_func"):
        HFCheckpoint(folder)


def test_fp8_block_scaled_weights_load_as_their_dequantized_values(tmp_path: Path):
    """DeepSeek's released FP8 layout: e4m3 weights with one fp32 `weight_scale_inv` per
    128 x 128 block. hearth reads them as value * scale: the same logits as a bf16/fp32 folder
    holding those dequantized values, and the scales count as read."""
    from safetensors.torch import load_file, save_file

    from hearth.models.weights import build_model
    from tests.model.test_hf_parity import PROMPT, PagedRun

    fp8 = write_random_deepseek(tmp_path / "fp8", num_layers=2, hidden_size=160,
                                intermediate_size=288)
    weights = load_file(str(fp8 / "model.safetensors"))
    dequantized = dict(weights)
    for name in [n for n in weights if n.endswith("proj.weight") and "experts" not in n]:
        w = weights[name]
        blocks = (-(-w.shape[0] // 128), -(-w.shape[1] // 128))
        scale = torch.rand(blocks) * 0.01 + 0.005
        full = scale.repeat_interleave(128, 0)[: w.shape[0]].repeat_interleave(128, 1)[:, : w.shape[1]]
        q = (w / full).to(torch.float8_e4m3fn)
        weights[name], weights[name + "_scale_inv"] = q, scale
        dequantized[name] = q.float() * full
    save_file(weights, str(fp8 / "model.safetensors"))
    plain = tmp_path / "plain"
    plain.mkdir()
    for f in ("config.json", "tokenizer.json"):
        (plain / f).write_text((fp8 / f).read_text())
    save_file(dequantized, str(plain / "model.safetensors"))
    assert any(n.endswith("_scale_inv") for n in load_file(str(fp8 / "model.safetensors")))
    build_model(HFCheckpoint(fp8), torch.float32)  # every tensor, scales included, is read
    torch.testing.assert_close(PagedRun(fp8).step(PROMPT), PagedRun(plain).step(PROMPT),
                               atol=1e-5, rtol=0)

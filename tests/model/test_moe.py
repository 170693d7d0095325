"""Mixture-of-Experts models (Qwen3-MoE, Mixtral) through the whole engine.

Logits parity per layout with transformers is in test_hf_parity.py (the per-expert layout that
`save_pretrained` writes); here: the packed 3-D layout of transformers 5's modules, greedy
tokens of the engine against a transformers greedy loop through chunked prefill, prefix hits,
preemption and speculative drafts, tensor and expert parallelism (and EP x PP) against one
process, and the load errors a broken checkpoint or a bad parallel size gets.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hearth.config import SpeculativeConfig
from hearth.engine.llm import LLM
from hearth.engine.sampling_params import SamplingParams
from hearth.models.hf_loader import HFCheckpoint
from hearth.ops.attention import build_attention_metadata
from hearth.models.random_checkpoint import _write_word_tokenizer, write_random_checkpoint
from tests.model.test_hf_parity import PROMPT, ATOL, PagedRun, hf_logits, make_hf_model

transformers = pytest.importorskip("transformers")

PROMPTS = [[(7 * i + 3 * j) % 250 + 3 for j in range(n)]
           for i, n in enumerate([5, 12, 23, 34, 47, 70])]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
EXACT = dict(dtype="float32", prefill_dtype="float32", kv_cache_dtype="model")


@pytest.fixture(scope="module")
def hf_moe(tmp_path_factory):
    """A tiny Qwen3-MoE from transformers (8 experts, top 2, renormalised), saved with a
    word-level tokenizer so the engine can serve the folder."""
    model, folder = make_hf_model(tmp_path_factory.mktemp("moe"), "qwen3-moe")
    _write_word_tokenizer(folder / "tokenizer.json", 256)
    return model, folder


def hf_greedy(model, prompt: list[int], num_tokens: int) -> list[int]:
    ids = list(prompt)
    for _ in range(num_tokens):
        ids.append(int(hf_logits(model, ids)[-1].argmax()))
    return ids[len(prompt):]


def test_packed_expert_layout_equals_transformers(tmp_path: Path, hf_moe) -> None:
    model, _ = hf_moe
    folder = tmp_path / "packed"
    folder.mkdir()
    # The module's own tensors: mlp.experts.gate_up_proj [E, 2I, H], mlp.experts.down_proj [E, H, I]
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert state["model.layers.0.mlp.experts.gate_up_proj"].dim() == 3
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(model.config.to_dict()))
    run = PagedRun(folder)
    torch.testing.assert_close(run.step(PROMPT), hf_logits(model, PROMPT), atol=ATOL, rtol=0)


def test_engine_greedy_equals_transformers_through_chunks_hits_preemption_and_drafts(hf_moe):
    model, folder = hf_moe
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
            else:  # the second round's outputs are drafted from the first's, and accepted
                assert llm.engine.speculator.counters.num_accepted_tokens > 0
        finally:
            llm.engine.close()
        assert [c.token_ids for c in first] == want
        assert [c.token_ids for c in second] == want
        assert sum(c.cached_tokens for c in second) > 0


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory) -> str:
    # 8 experts on 2 ranks: EP puts 4 whole experts on each; TP cuts each to half its width.
    return str(write_random_checkpoint(tmp_path_factory.mktemp("tiny-moe") / "m", num_layers=4,
                                       hidden_size=64, num_heads=4, num_kv_heads=2,
                                       vocab_size=256, num_experts=8, num_experts_per_tok=2,
                                       expert_intermediate_size=32))


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
def test_tensor_and_expert_parallel_equal_one_process(tiny_moe, parallel):
    settings = dict(num_blocks=16, max_num_batched_tokens=32)
    want, want_preemptions = run_twice(LLM(tiny_moe, **settings))
    got, preemptions = run_twice(LLM(tiny_moe, **settings, **parallel))
    assert want_preemptions > 0 and preemptions == want_preemptions
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids
        assert (g.prompt_tokens, g.cached_tokens) == (w.prompt_tokens, w.cached_tokens)
        for a, b in zip(w.logprobs, g.logprobs):
            assert abs(a.logprob - b.logprob) < 1e-4


def test_mixtral_layout_serves(tmp_path: Path):
    folder = write_random_checkpoint(tmp_path / "mixtral", num_layers=2, hidden_size=64,
                                     num_heads=4, num_kv_heads=2, vocab_size=256, num_experts=4,
                                     expert_intermediate_size=32, architecture="mixtral")
    checkpoint = HFCheckpoint(folder)
    assert checkpoint.arch.architecture == "mixtral"
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in checkpoint.tensor_names()
    llm = LLM(str(folder))
    try:
        out = llm.generate(PROMPTS[:2], GREEDY)
        assert all(len(c.token_ids) == GREEDY.max_tokens for c in out)
        assert llm.engine.kv_pool_is_whole()
    finally:
        llm.engine.close()


def _rewrite(folder: Path, edit) -> None:
    path = folder / "model.safetensors"
    weights = load_file(str(path))
    edit(weights)
    save_file(weights, str(path))


def test_broken_checkpoints_fail_at_load_naming_the_tensor(tmp_path: Path):
    def make(name: str) -> Path:
        return write_random_checkpoint(tmp_path / name, num_layers=2, hidden_size=64,
                                       num_heads=4, num_kv_heads=2, vocab_size=256,
                                       num_experts=4, expert_intermediate_size=32)

    missing = make("missing")
    _rewrite(missing, lambda w: w.pop("model.layers.1.mlp.experts.2.up_proj.weight"))
    with pytest.raises(ValueError, match=r"no tensor model\.layers\.1\.mlp\.experts\.2\.up_proj"
                                         r"\.weight \(expert 2 of MoE layer"):
        LLM(str(missing))

    misshaped = make("misshaped")
    _rewrite(misshaped, lambda w: w.update({"model.layers.0.mlp.experts.1.down_proj.weight":
                                            torch.zeros(64, 16)}))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.1\.down_proj\.weight"):
        LLM(str(misshaped))

    router = make("router")
    config = json.loads((router / "config.json").read_text())
    (router / "config.json").write_text(json.dumps({**config, "router_type": "sigmoid"}))
    with pytest.raises(ValueError, match="unknown router_type 'sigmoid'"):
        LLM(str(router))

    no_router = make("no-router")
    _rewrite(no_router, lambda w: w.pop("model.layers.0.mlp.gate.weight"))
    with pytest.raises(ValueError, match=r"no router for MoE layer model\.layers\.0\."):
        LLM(str(no_router))


def test_parallel_sizes_that_do_not_divide_the_experts_are_refused(tmp_path: Path):
    folder = write_random_checkpoint(tmp_path / "m", num_layers=2, hidden_size=64, num_heads=4,
                                     num_kv_heads=2, vocab_size=256, num_experts=6,
                                     expert_intermediate_size=34)
    with pytest.raises(ValueError, match=r"num_experts=6 \(--enable-expert-parallel\)"):
        LLM(str(folder), tensor_parallel_size=4, enable_expert_parallel=True)
    with pytest.raises(ValueError, match="the experts' intermediate size=34"):
        LLM(str(folder), tensor_parallel_size=4)


def decode_logits(model, tokens: list[int]) -> torch.Tensor:
    """Logits of every position, each computed as a 1-token step (the few-row path) over the
    model's own paged cache."""
    cache = torch.zeros(len(model.layers), 2, 8, 16, model.layers[0].self_attn.num_kv_heads,
                        model.arch.head_dim)
    out = []
    with torch.inference_mode():
        for i, token in enumerate(tokens):
            meta = build_attention_metadata([1], [i + 1], [list(range(8))], 16)
            hidden, _ = model(torch.tensor([token]), torch.tensor([i]), meta, cache)
            out.append(model.compute_logits(hidden))
    return torch.cat(out)


def test_quantized_experts_agree_with_fp32(tiny_moe):
    """Q8_0 experts (the kernel's few-row path) against the exact float model: top-1 agreement
    and KL over teacher-forced positions, as the dense formats are held (test_formats.py)."""
    from hearth.engine.executor import build_model_for
    from hearth.engine.llm import make_engine_config
    from hearth.ops.cpu_kernels import load_cpu_kernels

    if load_cpu_kernels() is None:
        pytest.skip("hearth's CPU kernels are not built here")
    folder = tiny_moe
    checkpoint = HFCheckpoint(folder)
    exact = build_model_for(make_engine_config(str(folder), quantization="none", **EXACT),
                            checkpoint).model
    quant = build_model_for(make_engine_config(str(folder), quantization="q8_0", **EXACT),
                            checkpoint).model
    experts = [layer.mlp.experts for layer in quant.layers]
    assert all(e.qw13 is not None and e.qw13.qtype == 8 for e in experts)
    tokens = PROMPTS[5][:64]
    want, got = decode_logits(exact, tokens), decode_logits(quant, tokens)
    top1 = (want.argmax(-1) == got.argmax(-1)).float().mean().item()
    logp_ref, logp = want.log_softmax(-1), got.log_softmax(-1)
    kl = (logp_ref.exp() * (logp_ref - logp)).sum(-1).mean().item()
    assert top1 >= 0.95 and kl < 1e-3, (top1, kl)


def write_moe_gguf(path: Path, folder: str, qtype=None) -> Path:
    """The HF folder `folder` (a tiny Qwen3-MoE or Mixtral from write_random_checkpoint) as
    llama.cpp converts it: `qwen3moe`, or Mixtral as `llama` with experts and Q/K rows permuted
    for interleaved RoPE; stacked ffn_{gate,up,down}_exps [E, I, H] / [E, H, I] and
    ffn_gate_inp; the experts, attention projections and output head in `qtype` (a
    gguf.GGMLQuantizationType; None: F32)."""
    import gguf
    import numpy as np
    from gguf.quants import quantize as reference_quantize

    from tests.model.test_loader import llama_cpp_permute

    config = json.loads((Path(folder) / "config.json").read_text())
    weights = load_file(str(Path(folder) / "model.safetensors"))
    mixtral = config["architectures"] == ["MixtralForCausalLM"]
    arch, num_layers = "llama" if mixtral else "qwen3moe", config["num_hidden_layers"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    num_experts = config["num_local_experts" if mixtral else "num_experts"]
    expert_width = config["intermediate_size" if mixtral else "moe_intermediate_size"]
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in (("block_count", num_layers), ("context_length", 1024),
                       ("embedding_length", config["hidden_size"]),
                       ("feed_forward_length", config["intermediate_size"]),
                       ("expert_feed_forward_length", expert_width),
                       ("expert_count", num_experts),
                       ("expert_used_count", config["num_experts_per_tok"]),
                       ("attention.head_count", heads), ("attention.head_count_kv", kv_heads),
                       ("attention.key_length", head_dim), ("attention.value_length", head_dim)):
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_float32(f"{arch}.rope.freq_base", 10000.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([chr(ord("a") + i % 26) * (1 + i // 26)
                           for i in range(config["vocab_size"])])
    writer.add_token_merges([])

    def add(name: str, tensor: torch.Tensor, qtype=None) -> None:
        data = tensor.float().numpy()
        if qtype is None:
            writer.add_tensor(name, np.ascontiguousarray(data))
        else:
            data = reference_quantize(data, qtype)
            writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)

    add("token_embd.weight", weights["model.embed_tokens.weight"])
    add("output_norm.weight", weights["model.norm.weight"])
    add("output.weight", weights["lm_head.weight"], qtype)
    moe = "block_sparse_moe." if mixtral else "mlp."
    expert_names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    for i in range(num_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        for hf, gg in (("input_layernorm", "attn_norm"), ("post_attention_layernorm", "ffn_norm"),
                       ("self_attn.q_proj", "attn_q"), ("self_attn.k_proj", "attn_k"),
                       ("self_attn.v_proj", "attn_v"), ("self_attn.o_proj", "attn_output"),
                       ("self_attn.q_norm", "attn_q_norm"), ("self_attn.k_norm", "attn_k_norm"),
                       (moe + "gate", "ffn_gate_inp")):
            if p + hf + ".weight" not in weights:
                continue  # Mixtral has no q/k norms
            tensor = weights[p + hf + ".weight"]
            if mixtral and gg in ("attn_q", "attn_k"):
                tensor = torch.from_numpy(llama_cpp_permute(
                    tensor.numpy(), heads if gg == "attn_q" else kv_heads))
            add(b + gg + ".weight", tensor, qtype if hf.endswith("_proj") else None)
        for hf, gg in zip(expert_names, ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")):
            stacked = torch.stack([weights[p + f"{moe}experts.{j}.{hf}.weight"]
                                   for j in range(num_experts)])
            add(b + gg + ".weight", stacked, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_qwen3moe_equals_the_hf_folder(tmp_path: Path, tiny_moe):
    """The same weights as a GGUF: in F32 they give the HF folder's logits; in Q8_0 the experts
    (and every linear) are served in the file's own blocks (quantization gguf), equal to the
    float model run on the dequantized weights up to summation order."""
    import gguf

    from hearth.engine.executor import build_model_for
    from hearth.engine.llm import make_engine_config
    from hearth.models.gguf_loader import GGUFCheckpoint
    from hearth.ops.cpu_kernels import load_cpu_kernels

    tokens = PROMPTS[5][:40]
    hf = build_model_for(make_engine_config(tiny_moe, quantization="none", **EXACT),
                         HFCheckpoint(tiny_moe)).model
    f32 = write_moe_gguf(tmp_path / "f32.gguf", tiny_moe)
    checkpoint = GGUFCheckpoint(f32)
    assert checkpoint.arch.architecture == "qwen3_moe" and checkpoint.arch.moe.num_experts == 8
    gguf_model = build_model_for(make_engine_config(str(f32), quantization="none", **EXACT),
                                 checkpoint).model
    torch.testing.assert_close(decode_logits(gguf_model, tokens), decode_logits(hf, tokens),
                               atol=1e-4, rtol=0)
    if load_cpu_kernels() is None:
        return
    q8 = write_moe_gguf(tmp_path / "q8.gguf", tiny_moe, gguf.GGMLQuantizationType.Q8_0)
    q8_checkpoint = GGUFCheckpoint(q8)
    served = build_model_for(make_engine_config(str(q8), quantization="gguf", **EXACT),
                             q8_checkpoint).model
    float_only = build_model_for(make_engine_config(str(q8), quantization="none", **EXACT),
                                 q8_checkpoint).model
    experts = served.layers[0].mlp.experts
    assert experts.qw13.qtype == 8 and experts.qw13.out_features == 8 * 2 * 32
    torch.testing.assert_close(decode_logits(served, tokens), decode_logits(float_only, tokens),
                               atol=1e-3, rtol=0)


def test_gguf_mixtral_is_llama_with_experts(tmp_path: Path):
    """llama.cpp writes Mixtral as `llama` with stacked experts and permuted Q/K rows: hearth
    reads it as Mixtral and computes the HF folder's logits."""
    from hearth.engine.executor import build_model_for
    from hearth.engine.llm import make_engine_config
    from hearth.models.gguf_loader import GGUFCheckpoint

    folder = str(write_random_checkpoint(tmp_path / "mixtral", num_layers=2, hidden_size=64,
                                         num_heads=4, num_kv_heads=2, vocab_size=256,
                                         num_experts=4, expert_intermediate_size=32,
                                         architecture="mixtral"))
    checkpoint = GGUFCheckpoint(write_moe_gguf(tmp_path / "mixtral.gguf", folder))
    assert checkpoint.arch.architecture == "mixtral" and checkpoint.arch.moe.num_experts == 4
    tokens = PROMPTS[4][:30]
    models = [build_model_for(make_engine_config(source, quantization="none", **EXACT),
                              ckpt).model
              for source, ckpt in ((folder, HFCheckpoint(folder)),
                                   (str(tmp_path / "mixtral.gguf"), checkpoint))]
    torch.testing.assert_close(decode_logits(models[1], tokens), decode_logits(models[0], tokens),
                               atol=1e-4, rtol=0)


def test_bf16_prompt_experts_replace_fp32_and_leave_decode_steps_alone(tiny_moe):
    """`--prefill-dtype auto` without AMX where bf16 GEMMs pay: packed experts keep the few-row
    steps (identical logits), prompt chunks use bf16 expert copies (close to fp32), and the
    float32 experts are gone."""
    from hearth.engine.executor import build_model_for
    from hearth.engine.llm import make_engine_config
    from hearth.models.moe import use_lowp_expert_prompts
    from hearth.ops.cpu_kernels import load_cpu_kernels

    if load_cpu_kernels() is None:
        pytest.skip("hearth's CPU kernels are not built here")
    checkpoint = HFCheckpoint(tiny_moe)

    def build(quantization: str):
        return build_model_for(make_engine_config(tiny_moe, quantization=quantization, **EXACT),
                               checkpoint).model

    exact, quant, mixed = build("none"), build("q8_0"), build("q8_0")
    assert use_lowp_expert_prompts(mixed, torch.bfloat16) == len(mixed.layers)
    experts = mixed.layers[0].mlp.experts
    assert experts.w13.dtype == experts.w2.dtype == torch.bfloat16
    tokens = PROMPTS[5][:48]
    assert torch.equal(decode_logits(mixed, tokens), decode_logits(quant, tokens))

    def prompt_logits(model):
        cache = torch.zeros(len(model.layers), 2, 8, 16, 2, model.arch.head_dim)
        meta = build_attention_metadata([len(tokens)], [len(tokens)], [list(range(8))], 16)
        with torch.inference_mode():
            hidden, _ = model(torch.tensor(tokens), torch.arange(len(tokens)), meta, cache)
            return model.compute_logits(hidden)

    want, got = prompt_logits(exact), prompt_logits(mixed)
    top1 = (want.argmax(-1) == got.argmax(-1)).float().mean().item()
    kl = (want.log_softmax(-1).exp() * (want.log_softmax(-1) - got.log_softmax(-1))).sum(-1)
    assert top1 >= 0.95 and kl.mean().item() < 5e-3, (top1, kl.mean().item())

"""--rope-scaling served through the flag equals transformers' forward pass with the same
rope_scaling in its config, in float32, past the trained context: a tiny random Llama with no
scaling of its own (trained context 64) at 4x that context, for linear, llama3 and yarn; and a
tiny random DeepSeek-V3 (MLA) whose own YaRN the flag replaces, as DeepSeek's checkpoints carry
one (RoPE over the qk_rope_head_dim dims, mscale_all_dim in the softmax).

The checkpoints are written by transformers offline (tests/model/test_hf_parity.py's cases)
with a word-level tokenizer, so the engine opens the folder as `hearth generate` would; the
flags are parsed by hearth's own parser. The prompt runs past position 64, where the scalings
differ most, as one chunk and as chunks over a cached prefix plus single-token decodes.
"""

from __future__ import annotations

import json

import pytest
import torch

from hearth import flags as hearth_flags
from hearth.engine.engine import LLMEngine
from hearth.models.random_checkpoint import _write_word_tokenizer
from hearth.ops.attention import build_attention_metadata
from hearth.ops.cpu_kernels import available_variants
from tests.model.test_hf_parity import ATOL, CASES, SHAPE, hf_logits, make_hf_model

transformers = pytest.importorskip("transformers")

TRAINED = SHAPE["max_position_embeddings"]  # 64
FACTOR = 4
SCALINGS = {
    "linear": {"rope_type": "linear", "factor": FACTOR},
    "llama3": {"rope_type": "llama3", "factor": FACTOR, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": TRAINED},
    "yarn": {"rope_type": "yarn", "factor": FACTOR, "original_max_position_embeddings": TRAINED},
}
# The DeepSeek checkpoint's own YaRN (test_hf_parity's "deepseek-v3-yarn"): trained at 16
# positions, stretched 4x to its max_position_embeddings of 64, mscale 0.8, mscale_all_dim 1.0.
# Each override restates what it computes with (hearth refuses one that would drop them).
DEEPSEEK_TRAINED = CASES["deepseek-v3-yarn"][1]["rope_scaling"]["original_max_position_embeddings"]
MLA_SCALINGS = {
    "yarn": {"rope_type": "yarn", "factor": TRAINED * FACTOR // DEEPSEEK_TRAINED,
             "original_max_position_embeddings": DEEPSEEK_TRAINED, "mscale": 1.0,
             "mscale_all_dim": 0.707},  # cos/sin by a ratio != 1, softmax by mscale^2
    "linear": {"rope_type": "linear", "factor": FACTOR, "mscale_all_dim": 1.0},  # 64 x 4
    "llama3": {"rope_type": "llama3", "factor": TRAINED * FACTOR // DEEPSEEK_TRAINED,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": DEEPSEEK_TRAINED,
               "mscale_all_dim": 0},  # DeepSeek's softmax correction turned off, explicitly
}
PROMPT = [(13 * i + 7) % 250 + 3 for i in range(3 * TRAINED + 9)]  # 201 tokens, past 3x trained
BLOCK_SIZE, NUM_BLOCKS = 4, 64


def saved_with_tokenizer(tmp_path_factory, case: str):
    model, folder = make_hf_model(tmp_path_factory.mktemp("rope"), case)
    _write_word_tokenizer(folder / "tokenizer.json", SHAPE["vocab_size"])
    return model, folder


@pytest.fixture(scope="module")
def unscaled(tmp_path_factory):
    """transformers' tiny Llama without rope_scaling, saved with a tokenizer."""
    return saved_with_tokenizer(tmp_path_factory, "llama")


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    """transformers' tiny DeepSeek-V3 with its own YaRN, saved with a tokenizer."""
    return saved_with_tokenizer(tmp_path_factory, "deepseek-v3-yarn")


def hf_scaled(case: str, checkpoint_model, scaling: dict):
    """The same weights under transformers with `scaling` in the config of test_hf_parity's
    `case` (and the context it scales to, as HF configs of such models say)."""
    config_class, overrides = CASES[case]
    config = getattr(transformers, config_class)(**{
        **SHAPE, **overrides, "max_position_embeddings": TRAINED * FACTOR,
        "rope_scaling": dict(scaling)})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(checkpoint_model.state_dict())
    return model.eval()


def engine_from_flags(folder, scaling: dict, cpu_kernels: str) -> LLMEngine:
    a = hearth_flags.build_parser().parse_args([
        "generate", "--model", str(folder), "--rope-scaling", json.dumps(scaling),
        "--max-model-len", str(TRAINED * FACTOR), "--cpu-kernels", cpu_kernels,
        "--dtype", "float32", "--prefill-dtype", "float32", "--kv-cache-dtype", "model",
        "--quantization", "none",
        "--block-size", str(BLOCK_SIZE), "--num-kv-blocks", str(NUM_BLOCKS), "a prompt"])
    return LLMEngine(hearth_flags.engine_config(a))


@torch.inference_mode()
def logits_in_chunks(engine: LLMEngine, chunks: list[int]) -> torch.Tensor:
    """The prompt's logits at every position, computed `chunks[i]` tokens at a time over the
    engine's own model and KV cache (blocks in reverse order, not the identity)."""
    runner = runner_of(engine)
    table = list(range(NUM_BLOCKS - 1, -1, -1))
    out, start = [], 0
    for n in chunks:
        meta = build_attention_metadata([n], [start + n], [table], BLOCK_SIZE)
        hidden, _ = runner.model(torch.tensor(PROMPT[start : start + n]),
                                 torch.arange(start, start + n), meta, runner.kv_cache)
        out.append(runner.model.compute_logits(hidden))
        start += n
    return torch.cat(out)


def runner_of(engine: LLMEngine):
    return engine.executor  # the in-process ModelRunner (T = P = 1)


@pytest.mark.parametrize("cpu_kernels", ["off", "auto"])
@pytest.mark.parametrize("name", list(SCALINGS))
def test_scaled_rope_by_flag_equals_transformers(unscaled, name, cpu_kernels):
    check_against_transformers("llama", *unscaled, SCALINGS[name], cpu_kernels)


@pytest.mark.parametrize("cpu_kernels", ["off", "auto"])
@pytest.mark.parametrize("name", list(MLA_SCALINGS))
def test_scaled_rope_by_flag_on_an_mla_model_equals_transformers(deepseek, name, cpu_kernels):
    check_against_transformers("deepseek-v3-yarn", *deepseek, MLA_SCALINGS[name], cpu_kernels)


def check_against_transformers(case: str, hf_model, folder, scaling: dict, cpu_kernels: str):
    if cpu_kernels == "auto" and not available_variants():
        pytest.skip("hearth's CPU kernels are not built here")
    want = hf_logits(hf_scaled(case, hf_model, scaling), PROMPT)
    # the override matters here: the checkpoint as it is (unscaled, or its own YaRN) is far off
    assert (hf_logits(hf_model, PROMPT) - want).abs().max() > 100 * ATOL
    engine = engine_from_flags(folder, scaling, cpu_kernels)
    try:
        assert engine.max_model_len == engine.arch.max_position_embeddings == TRAINED * FACTOR
        whole = logits_in_chunks(engine, [len(PROMPT)])
        torch.testing.assert_close(whole, want, atol=ATOL, rtol=0)
        decodes = [1] * 6
        chunked = logits_in_chunks(engine, [50, 90, len(PROMPT) - 146, *decodes])
        torch.testing.assert_close(chunked, want, atol=ATOL, rtol=0)
    finally:
        engine.close()


def test_the_unscaled_checkpoint_refuses_a_longer_max_model_len(unscaled):
    _, folder = unscaled
    a = hearth_flags.build_parser().parse_args([
        "generate", "--model", str(folder), "--max-model-len", str(TRAINED * FACTOR),
        "--cpu-kernels", "off", "--num-kv-blocks", str(NUM_BLOCKS), "a prompt"])
    with pytest.raises(ValueError, match="max_model_len 256: the model covers 64 positions"):
        LLMEngine(hearth_flags.engine_config(a))


def test_scaled_rope_under_tensor_and_pipeline_parallelism_equals_one_process(unscaled):
    """Every rank applies --rope-scaling to the checkpoint it opens (the LoadModel message
    carries it): T=2 x P=2 greedy tokens past the trained context equal one process's."""
    from hearth.engine.sampling_params import SamplingParams

    _, folder = unscaled
    scaling = json.dumps(SCALINGS["yarn"])
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    tokens = {}
    for parallel in ([], ["--tensor-parallel-size", "2", "--pipeline-parallel-size", "2"]):
        a = hearth_flags.build_parser().parse_args([
            "generate", "--model", str(folder), "--rope-scaling", scaling,
            "--max-model-len", str(TRAINED * FACTOR), "--cpu-kernels", "off",
            "--quantization", "none", "--kv-cache-dtype", "model", "--prefill-dtype", "float32",
            "--block-size", str(BLOCK_SIZE), "--num-kv-blocks", str(NUM_BLOCKS), *parallel,
            "a prompt"])
        engine = LLMEngine(hearth_flags.engine_config(a))
        try:
            assert engine.max_model_len == TRAINED * FACTOR
            engine.add_request("r", PROMPT[:150], params)  # decodes past 2x the trained context
            got = tokens[bool(parallel)] = []
            while engine.has_unfinished():
                for out in engine.step():
                    got += out.new_token_ids
        finally:
            engine.close()
    assert len(tokens[False]) == 24 and tokens[True] == tokens[False]

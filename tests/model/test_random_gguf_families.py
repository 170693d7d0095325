"""The real-size benchmark's gpt-oss and Llama 4 files (hearth/models/random_gguf.py), on tiny
shapes: hearth reads each family's fields from the keys and tensor names the writer puts down
(llama.cpp's: the same file serves llama-server), keeps the expert stacks only in the file's
blocks (MXFP4 experts included: no float copy at load), and computes what the float reference
of the same file computes.
"""

import pytest
import torch

from hearth.models.loader import load_checkpoint, resolve_builtin
from hearth.models.random_gguf import (MXFP4, Q4_K, Q6_K, GptOssShape, Llama4Shape,
                                       write_random_gguf)
from hearth.ops.cpu_kernels import available_variants
from tests.model.test_blocks_only import PROMPT_LEN, runner_for, tokens
from tests.model.test_formats import teacher_forced_logits

pytestmark = pytest.mark.skipif(not available_variants(), reason="CPU kernels not built")

GPT_OSS = GptOssShape(num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64,
                      num_experts=4, experts_per_tok=2, expert_intermediate_size=256,
                      sliding_window=16)
SCOUT = Llama4Shape(num_layers=4, hidden_size=256, intermediate_size=512, num_heads=4,
                    num_kv_heads=2, head_dim=64, num_experts=4, experts_per_tok=1,
                    expert_intermediate_size=256)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("families")
    tokenizer = resolve_builtin("smollm2-135m-instruct")
    return {name: write_random_gguf(folder / f"{name}.gguf", shape, tokenizer, mix, seed=3,
                                    context_length=4096)
            for name, shape, mix in (("gpt-oss", GPT_OSS, None), ("llama4", SCOUT, None),
                                     ("llama4-mxfp4", SCOUT, "mxfp4"))}


def test_gpt_oss_fields_come_from_llama_cpp_keys(files):
    arch = load_checkpoint(str(files["gpt-oss"])).arch
    assert arch.architecture == "gpt_oss"
    assert arch.family_spec.sliding_layers == (True, False)  # llama.cpp's pattern 2
    assert arch.family_spec.sliding_window == 16
    assert (arch.moe.num_experts, arch.moe.num_experts_per_tok,
            arch.moe.expert_intermediate_size) == (4, 2, 256)
    assert arch.attention_bias and arch.attention_out_bias and not arch.tie_word_embeddings
    assert arch.rope_scaling["rope_type"] == "yarn" and arch.rope_scaling["factor"] == 32.0


def test_llama4_fields_come_from_llama_cpp_keys(files):
    arch = load_checkpoint(str(files["llama4"])).arch
    spec = arch.family_spec
    assert spec.rope_layers == spec.chunked_layers == (True, True, True, False)  # NoPE: 4th
    assert spec.attention_chunk_size == 8192 and spec.qk_norm
    moe = arch.moe
    assert (moe.num_experts, moe.num_experts_per_tok, moe.num_shared_experts) == (4, 1, 1)
    assert moe.scoring_func == "sigmoid" and moe.dense_layers == ()
    assert arch.rope_scaling == {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 1.0,
                                 "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("name,qtypes", [("gpt-oss", ({MXFP4}, {MXFP4})),
                                         ("llama4", ({Q4_K}, {Q6_K})),
                                         ("llama4-mxfp4", ({MXFP4}, {MXFP4}))])
def test_experts_live_only_in_blocks_and_match_the_float_reference(files, name, qtypes):
    runner = runner_for(files[name], "gguf")
    experts = [layer.mlp.experts for layer in runner.model.layers]
    assert all(e.blocks_only for e in experts)
    assert ({e.qw13.qtype for e in experts}, {e.qw2.qtype for e in experts}) == qtypes
    seq = tokens()
    got = teacher_forced_logits(runner, seq, PROMPT_LEN)
    want = teacher_forced_logits(runner_for(files[name], "none"), seq, PROMPT_LEN)
    assert torch.isfinite(got).all() and want.abs().max() > 0
    kl = torch.nn.functional.kl_div(got.log_softmax(-1), want.log_softmax(-1), log_target=True,
                                    reduction="none").sum(-1)
    assert kl.mean() < 1e-3
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.85


def test_auto_takes_8_bit_activations_on_mxfp4_experts_within_the_8_bit_bounds(files, tmp_path):
    """`auto` on a gpt-oss file whose weight is mostly MXFP4 experts (as the real ones): 8-bit
    activations where the build multiplies in whole super-blocks (the AVX2 tiles: the MXFP4
    expert layer ~2.2x the float32 tile at one row), float32 ones where its embedding
    outweighs them; with 8-bit activations the model stays within the 8-bit bounds of the
    file's float reference (tests/model/test_formats.py's: top-1 >= 0.95, mean KL < 0.01)."""
    from dataclasses import replace

    from hearth.engine.executor import resolve_formats
    from hearth.engine.llm import make_engine_config

    wide = write_random_gguf(tmp_path / "wide.gguf",
                             replace(GPT_OSS, num_experts=32, expert_intermediate_size=1024),
                             resolve_builtin("smollm2-135m-instruct"), None, seed=3)

    def auto(path):
        config = make_engine_config(str(path), dtype="float32", quantization="auto")
        return resolve_formats(config, load_checkpoint(str(path)))

    fast = auto(wide).kernels.kquant_superblock_act()
    assert auto(wide).quantization == ("gguf-a8" if fast else "gguf")
    assert auto(files["gpt-oss"]).quantization == "gguf"  # 4 small experts, a 49k vocabulary
    runner = runner_for(files["gpt-oss"], "gguf-a8")
    experts = [layer.mlp.experts for layer in runner.model.layers]
    assert all(e.blocks_only and e.qw13.int8_act and e.qw13.qtype == MXFP4 for e in experts)
    seq = tokens()
    got = teacher_forced_logits(runner, seq, PROMPT_LEN)
    want = teacher_forced_logits(runner_for(files["gpt-oss"], "none"), seq, PROMPT_LEN)
    kl = torch.nn.functional.kl_div(got.log_softmax(-1), want.log_softmax(-1), log_target=True,
                                    reduction="none").sum(-1)
    assert torch.isfinite(got).all() and kl.mean() < 0.01
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.95

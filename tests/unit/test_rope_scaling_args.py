"""--rope-scaling (hearth/models/rope_scaling.py): the JSON it takes, the errors it gives, the
context it stretches the model to, and --max-model-len against that context. No model."""

import json
import re

import pytest

from hearth import flags as hearth_flags
from hearth.models.arch import MlaSpec, ModelArch, MoeSpec
from hearth.models.rope_scaling import context_length, parse_rope_scaling, with_rope_scaling

ARCH = ModelArch("llama", vocab_size=100, hidden_size=576, intermediate_size=1536, num_layers=30,
                 num_heads=9, num_kv_heads=3, head_dim=64, max_position_embeddings=8192)
YARN = '{"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192}'


@pytest.mark.parametrize("text, error", [
    ("yarn", "not JSON"),
    ('["yarn", 4]', "expected a JSON object"),
    ('{"factor": 4}', "'rope_type' is missing"),
    ('{"rope_type": "dynamic", "factor": 2}', "'dynamic' .* not supported"),
    ('{"type": "dynamic", "factor": 2}', "'dynamic' .* not supported"),  # the old key
    ('{"rope_type": "longrope", "factor": 2}', "unknown rope_type 'longrope'"),
    ('{"rope_type": "linear"}', "linear needs a 'factor'"),
    ('{"rope_type": "yarn", "factor": "4"}', "factor must be a number >= 1.0"),
    ('{"rope_type": "yarn", "factor": 0.5}', "factor must be a number >= 1.0"),
    ('{"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 0}',
     "original_max_position_embeddings must be a number >= 1"),
    ('{"rope_type": "llama3", "factor": 8, "low_freq_factor": 4, "high_freq_factor": 1}',
     "high_freq_factor > low_freq_factor"),
])
def test_bad_values_are_refused_saying_what_is_wrong(text, error):
    with pytest.raises(ValueError, match=error):
        parse_rope_scaling(text)


def test_the_flag_refuses_them_before_anything_starts(capsys):
    for command in ("serve", "up", "generate"):
        with pytest.raises(SystemExit):
            hearth_flags.build_parser().parse_args(
                [command, "--rope-scaling", '{"rope_type": "dynamic", "factor": 2}']
                + (["a prompt"] if command == "generate" else []))
        assert "'dynamic' (dynamic NTK) is not supported" in capsys.readouterr().err


def test_the_old_type_key_reads_as_rope_type():
    assert parse_rope_scaling('{"type": "linear", "factor": 2}') == {"rope_type": "linear",
                                                                    "factor": 2}


@pytest.mark.parametrize("text, context", [
    (YARN, 32768),  # the default model's 8k, stretched 4x
    ('{"rope_type": "linear", "factor": 2}', 16384),  # the checkpoint's own length 2x
    ('{"rope_type": "yarn", "factor": 2}', 16384),
    ('{"rope_type": "llama3", "factor": 2}', 16384),
    ('{"rope_type": "llama3", "factor": 8, "original_max_position_embeddings": 512}', 8192),
    ('{"rope_type": "default"}', 8192),
])
def test_the_context_grows_to_the_trained_length_times_the_factor(text, context):
    arch = with_rope_scaling(ARCH, text)
    assert arch.max_position_embeddings == context
    assert with_rope_scaling(ARCH, None) is ARCH
    if "yarn" in text or "llama3" in text:  # what the ramp is measured against, made explicit
        # (as transformers defaults it: the checkpoint's max_position_embeddings)
        assert arch.rope_scaling["original_max_position_embeddings"] == json.loads(text).get(
            "original_max_position_embeddings", 8192)
    if "default" in text:
        assert arch.rope_scaling is None


def test_max_model_len_is_checked_against_the_scaled_context():
    assert context_length(ARCH, None) == 8192
    assert context_length(ARCH, 4096) == 4096
    with pytest.raises(ValueError, match="max_model_len 32768: the model covers 8192 positions; "
                                         ".*--rope-scaling .*\"factor\": 4"):
        context_length(ARCH, 32768)
    assert context_length(with_rope_scaling(ARCH, YARN), 32768) == 32768


# A Kimi K2-like MLA checkpoint: trained at 64 positions, its own YaRN stretching it 4x.
KIMI_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
             "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
MLA = ModelArch("deepseek_v3", vocab_size=100, hidden_size=64, intermediate_size=96, num_layers=2,
                num_heads=4, num_kv_heads=4, head_dim=24, max_position_embeddings=256,
                rope_scaling=KIMI_YARN,
                mla=MlaSpec(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                            v_head_dim=16),
                moe=MoeSpec(num_experts=4, num_experts_per_tok=2, expert_intermediate_size=32))


def test_mla_models_take_it_in_place_of_their_own_yarn():
    text = ('{"rope_type": "yarn", "factor": 16, "original_max_position_embeddings": 64, '
            '"beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.707}')
    arch = with_rope_scaling(MLA, text)
    assert arch.rope_scaling == json.loads(text)  # whole: nothing of the checkpoint's is merged in
    assert (arch.max_position_embeddings, arch.rotary_dim) == (1024, 8)
    plain = with_rope_scaling(MLA, '{"rope_type": "default"}')  # the checkpoint's YaRN removed
    assert (plain.rope_scaling, plain.max_position_embeddings) == (None, 256)


@pytest.mark.parametrize("text, dropped", [
    ('{"rope_type": "yarn", "factor": 8}',  # (beta_slow 1 is what it gets anyway)
     "original_max_position_embeddings=64, beta_fast=1.0, mscale=1.0, mscale_all_dim=1.0, "
     "which yarn"),
    ('{"rope_type": "yarn", "factor": 8, "original_max_position_embeddings": 64, "mscale": 1, '
     '"mscale_all_dim": 1}', "beta_fast=1.0, which yarn"),
    ('{"rope_type": "linear", "factor": 2}', "mscale_all_dim=1.0, which linear"),  # MLA's softmax
    ('{"rope_type": "llama3", "factor": 8, "mscale_all_dim": 0}',
     "original_max_position_embeddings=64, which llama3"),
])
def test_an_override_that_would_drop_what_the_checkpoint_says_is_refused(text, dropped):
    """It replaces the checkpoint's rope_scaling whole (as vLLM's --hf-overrides does): what the
    checkpoint's scaling says and the new type computes with must be restated, not lost unseen."""
    with pytest.raises(ValueError, match="replaces the checkpoint's own rope_scaling whole .* "
                                         f"would drop {re.escape(dropped)} on this model"):
        with_rope_scaling(MLA, text)


def test_a_checkpoint_stretched_past_its_trained_length_needs_that_length_restated():
    llama31 = ModelArch("llama", vocab_size=100, hidden_size=64, intermediate_size=96,
                        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                        max_position_embeddings=131072,
                        rope_scaling={"rope_type": "llama3", "factor": 16.0,
                                      "original_max_position_embeddings": 8192})
    with pytest.raises(ValueError, match="would drop original_max_position_embeddings=8192"):
        with_rope_scaling(llama31, '{"rope_type": "yarn", "factor": 32}')
    restated = '{"rope_type": "yarn", "factor": 32, "original_max_position_embeddings": 8192}'
    assert with_rope_scaling(llama31, restated).max_position_embeddings == 262144
    # linear reads no trained length, and a dense model no mscale: nothing to restate
    assert with_rope_scaling(llama31, '{"rope_type": "linear", "factor": 2}').rope_scaling == {
        "rope_type": "linear", "factor": 2}


def test_the_flag_reaches_the_engine_config_and_round_trips_through_serve_argv():
    for command in ("serve", "up", "generate"):
        argv = [command, "--rope-scaling", YARN, "--max-model-len", "32768"]
        if command == "generate":
            argv.append("a prompt")
        a = hearth_flags.build_parser().parse_args(argv)
        model = hearth_flags.engine_config(a).model
        assert (model.rope_scaling, model.max_model_len) == (YARN, 32768)
    a = hearth_flags.build_parser().parse_args(["serve", "--rope-scaling", YARN])
    hearth_flags.read_secrets(a, {})
    engine, server = hearth_flags.engine_config(a), hearth_flags.server_config(a)
    argv = hearth_flags.serve_argv(engine, server)
    assert argv[argv.index("--rope-scaling") + 1] == YARN

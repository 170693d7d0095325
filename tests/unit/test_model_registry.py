"""The family registry, MoE shapes in ModelArch, and how MoE models may be split across ranks."""

import pytest

from hearth.engine.parallel.layout import check_parallel_shape
from hearth.models.arch import SUPPORTED_ARCHITECTURES, ModelArch, MoeSpec
from hearth.models.registry import GGUF_ARCHITECTURES, HF_ARCHITECTURES, model_class


def make_arch(architecture: str = "qwen3_moe", moe: MoeSpec | None = None, **kw) -> ModelArch:
    shape = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=4,
                 num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=128)
    if moe is None and architecture in ("qwen3_moe", "mixtral"):
        moe = MoeSpec(num_experts=8, num_experts_per_tok=2, expert_intermediate_size=32)
    return ModelArch(architecture=architecture, moe=moe, **{**shape, **kw})


def test_every_family_has_a_model_class_and_every_file_name_a_family():
    assert set(HF_ARCHITECTURES.values()) <= set(SUPPORTED_ARCHITECTURES)
    assert {family for family, _ in GGUF_ARCHITECTURES.values()} <= set(SUPPORTED_ARCHITECTURES)
    classes = {arch: model_class(arch).__name__ for arch in SUPPORTED_ARCHITECTURES}
    assert classes["llama"] == classes["qwen3"] == "LlamaForCausalLM"
    assert classes["mixtral"] == classes["qwen3_moe"] == "MoeLlamaForCausalLM"
    with pytest.raises(ValueError, match="no model class for architecture 'gpt2'"):
        model_class("gpt2")


def test_moe_settings_belong_to_moe_families_only():
    with pytest.raises(ValueError, match="'qwen3_moe' needs MoE settings"):
        ModelArch(architecture="qwen3_moe", vocab_size=8, hidden_size=8, intermediate_size=8,
                  num_layers=1, num_heads=1, num_kv_heads=1, head_dim=8,
                  max_position_embeddings=8)
    with pytest.raises(ValueError, match="'llama' takes no MoE settings"):
        make_arch("llama", MoeSpec(num_experts=2, num_experts_per_tok=1,
                                   expert_intermediate_size=8))
    with pytest.raises(ValueError, match=r"num_experts_per_tok=9 must be in 1..num_experts=8"):
        MoeSpec(num_experts=8, num_experts_per_tok=9, expert_intermediate_size=8)
    arch = make_arch(moe=MoeSpec(num_experts=8, num_experts_per_tok=2,
                                 expert_intermediate_size=32, dense_layers=(1,)))
    assert [arch.is_moe_layer(i) for i in range(4)] == [True, False, True, True]


def test_parallel_shapes_of_moe_models():
    arch = make_arch(intermediate_size=90)  # no dense layer: the dense width does not matter
    check_parallel_shape(arch, 2, 1)
    check_parallel_shape(arch, 4, 1, expert_parallel=True)  # 8 experts, 2 per rank
    with pytest.raises(ValueError, match=r"num_experts=8 \(--enable-expert-parallel\)"):
        check_parallel_shape(make_arch(num_heads=12, num_kv_heads=3), 3, 1, expert_parallel=True)
    with pytest.raises(ValueError, match="the experts' intermediate size=32"):
        check_parallel_shape(make_arch(num_heads=12, num_kv_heads=3), 3, 1)
    dense_layer = make_arch(intermediate_size=90, moe=MoeSpec(
        num_experts=8, num_experts_per_tok=2, expert_intermediate_size=32, dense_layers=(0,)))
    with pytest.raises(ValueError, match="intermediate_size=90"):
        check_parallel_shape(dense_layer, 4, 1)


def test_expert_imbalance_is_the_worst_layers_busiest_expert_over_its_mean():
    from hearth.bench.engine_bench import expert_imbalance

    assert expert_imbalance({0: [4, 4, 4, 4]}) == 1.0
    assert expert_imbalance({0: [4, 4, 4, 4], 5: [10, 2, 2, 2]}) == 2.5
    assert expert_imbalance({0: [0, 0]}) == 1.0  # nothing routed yet

"""The family registry, MoE shapes in ModelArch, and how MoE models may be split across ranks."""

import ast
import dataclasses
from pathlib import Path

import pytest

import hearth.models.arch
from hearth.engine.parallel.layout import check_parallel_shape
from hearth.models import registry
from hearth.models.arch import ModelArch, MoeSpec
from hearth.models.registry import (FAMILIES, MLA_ARCHITECTURES, MOE_ARCHITECTURES,
                                    SUPPORTED_ARCHITECTURES, family_of, gguf_family, hf_family,
                                    model_class)

FAMILIES_DIR = Path(hearth.models.arch.__file__).parent / "families"


def make_arch(architecture: str = "qwen3_moe", moe: MoeSpec | None = None, **kw) -> ModelArch:
    shape = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=4,
                 num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=128)
    if moe is None and architecture in ("qwen3_moe", "mixtral"):
        moe = MoeSpec(num_experts=8, num_experts_per_tok=2, expert_intermediate_size=32)
    return ModelArch(architecture=architecture, moe=moe, **{**shape, **kw})


def test_every_family_name_resolves_to_its_family_and_code():
    for family in FAMILIES:
        for hf_name, architecture in family.hf_names.items():
            assert hf_family(hf_name, "f") == (family, architecture)
        for gguf_name, architecture in family.gguf_names.items():
            assert gguf_family(gguf_name, family.is_moe, "f") == (family, architecture)
        for architecture in family.architectures:
            assert family_of(architecture) is family
            assert model_class(architecture) is family.model_class()
        assert callable(family.weight_loader())
        hooks = family.quant_hooks()
        assert hooks is None or (callable(hooks.attention_linears)
                                 and callable(hooks.quantize_attention))
    classes = {arch: model_class(arch).__name__ for arch in SUPPORTED_ARCHITECTURES}
    assert classes["llama"] == classes["qwen3"] == "LlamaForCausalLM"
    assert classes["mixtral"] == classes["qwen3_moe"] == "MoeLlamaForCausalLM"
    assert classes["deepseek_v2"] == classes["deepseek_v3"] == "DeepseekV3ForCausalLM"
    assert classes["llama4"] == "Llama4ForCausalLM"
    assert classes["gpt_oss"] == "GptOssForCausalLM"
    # Llama 4's published checkpoints are the multimodal model: its text model is served
    assert hf_family("Llama4ForConditionalGeneration", "f")[1] == "llama4"
    # llama.cpp's "llama" holds Llama and (with experts) Mixtral: the experts pick the family
    assert gguf_family("llama", False, "f")[1] == "llama"
    assert gguf_family("llama", True, "f")[1] == "mixtral"
    assert gguf_family("llama4", True, "f")[1] == "llama4"
    assert gguf_family("gpt-oss", True, "f")[1] == "gpt_oss"
    with pytest.raises(ValueError, match="a qwen2 file with experts is not supported"):
        gguf_family("qwen2", True, "f")
    with pytest.raises(ValueError, match="GGUF architecture 'gpt2' is not supported"):
        gguf_family("gpt2", False, "f")
    with pytest.raises(ValueError, match="architecture 'GPT2LMHeadModel' is not supported"):
        hf_family("GPT2LMHeadModel", "f")
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'; hearth supports llama"):
        model_class("gpt2")


def test_the_arch_tables_are_derived_from_the_families():
    assert SUPPORTED_ARCHITECTURES == ("llama", "mistral", "qwen2", "qwen3", "mixtral",
                                       "qwen3_moe", "deepseek_v2", "deepseek_v3", "llama4",
                                       "gpt_oss")
    assert MOE_ARCHITECTURES == tuple(a for f in FAMILIES if f.is_moe for a in f.architectures)
    assert MOE_ARCHITECTURES == ("mixtral", "qwen3_moe", "deepseek_v2", "deepseek_v3", "llama4",
                                 "gpt_oss")
    assert MLA_ARCHITECTURES == ("deepseek_v2", "deepseek_v3")
    for name in ("SUPPORTED_ARCHITECTURES", "MOE_ARCHITECTURES", "MLA_ARCHITECTURES"):
        assert not hasattr(hearth.models.arch, name)  # one source: the registry


def test_each_family_folder_is_registered_and_each_registered_family_has_its_folder():
    """A new family is its folder (with FAMILY in __init__.py) and a line in FAMILIES: a folder
    without the line, or a line without the folder, fails here."""
    folders = sorted(p.name for p in FAMILIES_DIR.iterdir() if (p / "__init__.py").exists())
    assert folders == sorted(f.name for f in FAMILIES)
    for family in FAMILIES:
        assert (FAMILIES_DIR / family.name / "model.py").exists()
        assert (FAMILIES_DIR / family.name / "loading.py").exists()


def test_no_module_outside_the_families_names_an_architecture():
    """hearth/models and the engine never compare against an architecture's name: what differs
    per family is asked of its Family (the random checkpoint writers, test factories, excepted)."""
    names = set(SUPPORTED_ARCHITECTURES) | {g for f in FAMILIES for g in f.gguf_names}
    root = FAMILIES_DIR.parent.parent
    paths = [p for p in (root / "models").glob("*.py") if not p.name.startswith("random_")]
    paths += list((root / "engine").glob("*.py"))
    found = [f"{p.relative_to(root)}: {node.value!r}" for p in paths
             for node in ast.walk(ast.parse(p.read_text()))
             if isinstance(node, ast.Constant) and node.value in names]
    assert found == []


def test_families_may_not_claim_the_same_names():
    llama = family_of("llama")
    check_families = registry.check_families
    twin = dataclasses.replace(llama, name="twin", architectures=("twin",), hf_names={},
                               gguf_names={"qwen2": "twin"})
    with pytest.raises(ValueError, match=r"gguf qwen2 \(dense\) is claimed by families llama "
                                         r"and twin"):
        check_families((llama, twin))
    clash = dataclasses.replace(twin, hf_names={"LlamaForCausalLM": "twin"}, gguf_names={})
    with pytest.raises(ValueError, match="'LlamaForCausalLM' is claimed by families llama"):
        check_families((llama, clash))
    with pytest.raises(ValueError, match="names map to"):
        dataclasses.replace(twin, hf_names={"X": "llama"})
    check_families((llama, dataclasses.replace(twin, gguf_names={"qwen2": "twin"}, is_moe=True)))


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

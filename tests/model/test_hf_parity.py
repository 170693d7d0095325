"""Logits parity with HF transformers for every architecture and rope_scaling type hearth claims.

Each case is a tiny random-weight checkpoint that transformers builds offline from a config and
writes with `save_pretrained`; hearth opens the folder with its own HF loader and runs its own
model over the paged cache. Both run in float32, so the logits agree to float rounding: a missing
bias, a skipped norm or a wrong RoPE frequency moves them by O(1), far outside the tolerance.
What is compared: every position of a whole-prompt prefill, and the same prompt split into a
prefill chunk, a second chunk over the cached prefix, and single-token decodes.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from hearth.models.hf_loader import HFCheckpoint
from hearth.models.weights import build_model
from hearth.ops.attention import build_attention_metadata

transformers = pytest.importorskip("transformers")

BLOCK_SIZE = 4
NUM_BLOCKS = 16
PROMPT = [(11 * i + 5) % 250 + 3 for i in range(37)]  # spans several blocks, ends mid-block
ATOL = 2e-4  # float32 rounding over 3 layers; logits are O(1..10)

SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
             rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
DEEPSEEK = dict(num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
                qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
                moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
                n_group=4, topk_group=2, routed_scaling_factor=2.5)
CASES = {
    "llama": ("LlamaConfig", dict(rope_theta=10000.0)),
    "llama-tied": ("LlamaConfig", dict(tie_word_embeddings=True)),
    "llama-bias": ("LlamaConfig", dict(attention_bias=True)),  # q/k/v and o_proj biases
    "llama-mlp-bias": ("LlamaConfig", dict(mlp_bias=True)),
    "qwen2": ("Qwen2Config", dict(rope_theta=1000000.0, use_sliding_window=False)),
    "qwen2-tied": ("Qwen2Config", dict(tie_word_embeddings=True, use_sliding_window=False)),
    "qwen3": ("Qwen3Config", dict(head_dim=32, use_sliding_window=False)),  # head_dim != hidden/heads
    "mistral": ("MistralConfig", dict(sliding_window=None, head_dim=16)),
    # rope_scaling types (positions past the original length are where they differ)
    "rope-linear": ("LlamaConfig", dict(rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "rope-llama3": ("LlamaConfig", dict(rope_scaling={
        "rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16})),
    "rope-yarn": ("Qwen3Config", dict(head_dim=16, use_sliding_window=False, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16})),
    "rope-yarn-no-original": ("LlamaConfig", dict(rope_scaling={"rope_type": "yarn", "factor": 2.0})),
    # Mixture-of-Experts: 8 experts, top 2 (renormalised or not), a dense layer among sparse ones
    "mixtral": ("MixtralConfig", dict(num_local_experts=8, num_experts_per_tok=2,
                                      sliding_window=None, head_dim=16)),
    "qwen3-moe": ("Qwen3MoeConfig", dict(num_experts=8, num_experts_per_tok=2, head_dim=32,
                                         moe_intermediate_size=48, norm_topk_prob=True)),
    "qwen3-moe-dense-layer": ("Qwen3MoeConfig", dict(
        num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=False,
        mlp_only_layers=[1])),
    # DeepSeek-V3 / Kimi K2 (MLA + sigmoid noaux_tc router with a correction bias, grouped
    # top-k, shared experts, a dense first layer) and V2 (softmax, group-limited, no q bottleneck)
    "deepseek-v3": ("DeepseekV3Config", dict(DEEPSEEK, q_lora_rank=24)),
    "deepseek-v3-yarn": ("DeepseekV3Config", dict(DEEPSEEK, q_lora_rank=24, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
        "mscale": 0.8, "mscale_all_dim": 1.0})),
    "deepseek-v2": ("DeepseekV2Config", dict(DEEPSEEK, q_lora_rank=None,
                                             topk_method="group_limited_greedy")),
}


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights of O(1) activations (HF's init, std 0.02, makes near-uniform logits)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * noise)
            elif name.endswith(".bias"):
                param.copy_(0.5 * noise)
            elif param.dim() >= 2 and "embed_tokens" not in name:  # 3-D: stacked experts
                param.copy_(noise / param.shape[-1] ** 0.5)
            else:
                param.copy_(noise)
        for name, buf in model.named_buffers():  # DeepSeek-V3's router bias: steer some picks
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.05 * torch.randn(buf.shape, generator=gen))


def make_hf_model(tmp_path: Path, case: str):
    config_class, overrides = CASES[case]
    config = getattr(transformers, config_class)(**{**SHAPE, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize(model, seed=sum(map(ord, case)))
    if config.tie_word_embeddings:
        model.tie_weights()
    model.eval()
    folder = tmp_path / case
    model.save_pretrained(folder)
    return model, folder


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()  # [num_tokens, vocab]


class PagedRun:
    """hearth's model over its own paged cache: one request, computed chunk by chunk; with
    `kernels`, through hearth's CPU kernels (norms, RoPE + KV write, SiLU-mul, decode attention)
    as the engine runs it."""

    def __init__(self, folder: Path, kernels=None) -> None:
        self.model = build_model(HFCheckpoint(folder), torch.float32)
        if kernels is not None:
            self.model.use_kernels(kernels)
        planes, heads, dim = self.model.arch.kv_cache_layout()
        self.kv_cache = torch.zeros(len(self.model.layers), planes, NUM_BLOCKS, BLOCK_SIZE,
                                    heads, dim)
        self.block_table = list(range(NUM_BLOCKS - 1, -1, -1))  # not the identity on purpose
        self.num_computed = 0

    @torch.inference_mode()
    def step(self, ids: list[int]) -> torch.Tensor:
        """Compute `ids` after the tokens already in the cache; logits of every one of them."""
        start, end = self.num_computed, self.num_computed + len(ids)
        meta = build_attention_metadata([len(ids)], [end], [self.block_table], BLOCK_SIZE)
        positions = torch.arange(start, end)
        hidden, _ = self.model(torch.tensor(ids), positions, meta, self.kv_cache)
        self.num_computed = end
        return self.model.compute_logits(hidden)


@pytest.fixture(scope="module")
def cpu_kernels():
    from hearth.ops.cpu_kernels import load_cpu_kernels

    kernels = load_cpu_kernels("auto")
    if kernels is None:
        pytest.skip("hearth's CPU kernels are not built here")
    return kernels


@pytest.mark.parametrize("case", list(CASES))
def test_logits_equal_transformers(tmp_path: Path, case: str) -> None:
    check_parity(tmp_path, case, kernels=None)


@pytest.mark.parametrize("case", ["llama-bias", "llama-mlp-bias", "qwen2", "qwen3", "mistral",
                                  "mixtral", "qwen3-moe", "deepseek-v3", "deepseek-v2"])
def test_logits_equal_transformers_through_the_cpu_kernels(tmp_path: Path, case: str,
                                                           cpu_kernels) -> None:
    check_parity(tmp_path, case, kernels=cpu_kernels)


def check_parity(tmp_path: Path, case: str, kernels) -> None:
    hf_model, folder = make_hf_model(tmp_path, case)
    want = hf_logits(hf_model, PROMPT)
    assert want.std() > 0.5  # a meaningful spread: near-uniform logits would hide errors

    whole = PagedRun(folder, kernels).step(PROMPT)
    torch.testing.assert_close(whole, want, atol=ATOL, rtol=0)

    chunked = PagedRun(folder, kernels)
    got = [chunked.step(PROMPT[:13]), chunked.step(PROMPT[13:30])]  # second over a cached prefix
    got += [chunked.step([token]) for token in PROMPT[30:]]  # decodes
    torch.testing.assert_close(torch.cat(got), want, atol=ATOL, rtol=0)


def test_loaded_arch_matches_the_config(tmp_path: Path) -> None:
    _, folder = make_hf_model(tmp_path, "qwen3")
    arch = HFCheckpoint(folder).arch
    assert (arch.architecture, arch.head_dim, arch.qk_norm, arch.attention_bias) == ("qwen3", 32, True, False)
    _, folder = make_hf_model(tmp_path, "qwen2-tied")
    arch = HFCheckpoint(folder).arch
    assert (arch.architecture, arch.attention_bias, arch.tie_word_embeddings) == ("qwen2", True, True)
    assert math.isclose(HFCheckpoint(make_hf_model(tmp_path, "qwen2")[1]).arch.rope_theta, 1e6)


# rope_scaling as config.json files write it (old "type" key, missing optional fields), read by
# hearth's loader; frequencies and cos/sin scale against transformers' own functions.
ROPE_CONFIGS = [
    {"type": "linear", "factor": 3.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 256},
    {"type": "yarn", "factor": 4.0},  # original length: the config's max_position_embeddings
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512, "beta_fast": 16,
     "beta_slow": 2, "attention_factor": 0.9},
    {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 256, "mscale": 1.0,
     "mscale_all_dim": 0.5, "truncate": False},
]


@pytest.mark.parametrize("scaling", ROPE_CONFIGS, ids=lambda s: "-".join(map(str, s.values()))[:40])
def test_rope_scaling_frequencies_equal_transformers(tmp_path: Path, scaling: dict) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from hearth.models.hf_loader import arch_from_hf_config
    from hearth.models.layers import _rope_inv_freq

    config = {**SHAPE, "architectures": ["LlamaForCausalLM"], "hidden_size": 256,
              "max_position_embeddings": 2048, "rope_theta": 500000.0, "rope_scaling": dict(scaling)}
    arch = arch_from_hf_config(config, tmp_path)
    ours, ours_scale = _rope_inv_freq(arch.head_dim, arch.rope_theta, arch.rope_scaling)
    hf_config = transformers.LlamaConfig(**{k: v for k, v in config.items() if k != "architectures"})
    rope_type = hf_config.rope_parameters["rope_type"]
    want, want_scale = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")
    torch.testing.assert_close(ours.float(), want.float(), rtol=1e-6, atol=0)
    assert math.isclose(ours_scale, want_scale, rel_tol=1e-9)


def test_dynamic_rope_is_refused_at_load(tmp_path: Path) -> None:
    from hearth.models.hf_loader import arch_from_hf_config

    config = {**SHAPE, "architectures": ["LlamaForCausalLM"],
              "rope_scaling": {"type": "dynamic", "factor": 2.0}}
    with pytest.raises(ValueError, match=r"rope_scaling type 'dynamic' \(dynamic NTK\) is not "
                                         r"supported.*max_position_embeddings \(64\)"):
        arch_from_hf_config(config, tmp_path)
    config["rope_scaling"] = {"rope_type": "longrope", "factor": 2.0}
    with pytest.raises(ValueError, match="unsupported rope_scaling type 'longrope'; hearth "
                                         "supports default, linear, llama3, yarn"):
        arch_from_hf_config(config, tmp_path)


def test_a_tensor_the_model_has_no_place_for_is_an_error(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    _, folder = make_hf_model(tmp_path, "qwen2")  # q/k/v biases, none on o_proj
    weights = load_file(str(folder / "model.safetensors"))
    weights["model.layers.1.self_attn.o_proj.bias"] = torch.ones(64)
    save_file(weights, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="checkpoint tensors the qwen2 model has no place for: "
                                         "model.layers.1.self_attn.o_proj.bias"):
        build_model(HFCheckpoint(folder), torch.float32)


def test_deepseek_arch_and_yarn_softmax_scale_match_transformers(tmp_path: Path) -> None:
    """MLA's shape is read from the config, and YaRN's mscale_all_dim scales the softmax as
    transformers does (the parity case above would catch it too; this names the cause)."""
    from hearth.models.families.deepseek.model import mla_softmax_scale

    hf_model, folder = make_hf_model(tmp_path, "deepseek-v3-yarn")
    arch = HFCheckpoint(folder).arch
    assert (arch.mla.kv_lora_rank, arch.mla.qk_rope_head_dim, arch.mla.q_lora_rank) == (32, 8, 24)
    assert arch.kv_cache_layout(tp_size=2) == (1, 1, 40)  # one latent row, replicated
    assert (arch.moe.scoring_func, arch.moe.topk_method, arch.moe.dense_layers) == (
        "sigmoid", "noaux_tc", (0,))
    want = hf_model.model.layers[0].self_attn.scaling
    assert want != pytest.approx(arch.mla.qk_head_dim ** -0.5)
    assert mla_softmax_scale(arch) == pytest.approx(want, rel=1e-6)


def hf_greedy(model, prompt: list[int], num_tokens: int) -> tuple[list[int], list[float]]:
    """transformers' greedy continuation of `prompt` and each chosen token's logprob."""
    ids, logprobs = list(prompt), []
    for _ in range(num_tokens):
        logits = torch.log_softmax(hf_logits(model, ids)[-1], -1)
        ids.append(int(logits.argmax()))
        logprobs.append(float(logits[ids[-1]]))
    return ids[len(prompt):], logprobs


def check_engine_greedy(path, reference, prompts: list[list[int]], params, **llm_kwargs) -> None:
    """An engine on `path` runs `prompts` twice (the second round hits the prefix cache):
    both rounds' greedy tokens and logprobs equal transformers' `reference`, pool whole."""
    from hearth.engine.llm import LLM

    want = [hf_greedy(reference, p, params.max_tokens) for p in prompts]
    llm = LLM(str(path), **llm_kwargs)
    try:
        first = llm.generate(prompts, params)
        second = llm.generate(prompts, params)
        assert llm.engine.kv_pool_is_whole()
    finally:
        llm.engine.close()
    assert sum(c.cached_tokens for c in second) > 0
    for got in (first, second):
        for completion, (tokens, logprobs) in zip(got, want):
            assert completion.token_ids == tokens
            assert [lp.logprob for lp in completion.logprobs] == pytest.approx(logprobs, abs=1e-4)

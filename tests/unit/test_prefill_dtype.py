"""--prefill-dtype: which steps run in bfloat16, how the choice resolves, and that bf16 attention
(a fresh prompt, a chunk after a cached prefix) computes the same attention to bf16 precision."""

import pytest
import torch

from hearth.config import EngineConfig, ModelConfig, ParallelConfig
from hearth.engine import executor
from hearth.models.layers import LOWP_MIN_ROWS as GEMM_MIN_ROWS
from hearth.models.layers import ColumnParallelLinear, use_lowp_prefill
from hearth.models.parallel_group import ParallelGroup
from hearth.ops.attention import build_attention_metadata
from hearth.ops.cpu_kernels import load_cpu_kernels
from tests.attention_steps import paged_attention


def config(choice: str, **parallel) -> EngineConfig:
    return EngineConfig(model=ModelConfig(prefill_dtype=choice), parallel=ParallelConfig(**parallel))


def test_choices_resolve(monkeypatch):
    assert executor.resolve_prefill_dtype(config("float32")) == torch.float32
    assert executor.resolve_prefill_dtype(config("bfloat16")) == torch.bfloat16
    monkeypatch.setattr(executor, "amx_usable", lambda: True)
    assert executor.resolve_prefill_dtype(config("auto")) == torch.bfloat16
    monkeypatch.setattr(executor, "amx_usable", lambda: False)
    assert executor.resolve_prefill_dtype(config("auto")) == torch.float32


def test_bad_and_unsupported_choices_are_refused(monkeypatch):
    with pytest.raises(ValueError, match="prefill_dtype: unsupported 'fp8'"):
        executor.resolve_prefill_dtype(config("fp8"))
    with pytest.raises(ValueError, match="tensor/pipeline"):
        executor.resolve_prefill_dtype(config("bfloat16", tensor_parallel_size=2))
    monkeypatch.setattr(executor, "amx_usable", lambda: True)  # auto falls back, never refuses
    assert executor.resolve_prefill_dtype(config("auto", tensor_parallel_size=2)) == torch.float32
    bf16_model = EngineConfig(model=ModelConfig(dtype="bfloat16", prefill_dtype="auto"))
    assert executor.resolve_prefill_dtype(bf16_model) == torch.bfloat16  # the model's own


def test_only_many_row_steps_use_the_bf16_copy():
    torch.manual_seed(0)
    layer = ColumnParallelLinear(64, 96, True, ParallelGroup())
    layer.weight.data.normal_()
    layer.bias.data.normal_()

    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = layer

    assert use_lowp_prefill(Holder(), torch.bfloat16) == 1
    few = torch.randn(GEMM_MIN_ROWS, 64)
    assert torch.equal(layer(few), torch.nn.functional.linear(few, layer.weight, layer.bias))
    many = torch.randn(GEMM_MIN_ROWS + 1, 64)
    out = layer(many)
    exact = torch.nn.functional.linear(many, layer.weight, layer.bias)
    lowp = torch.nn.functional.linear(many.bfloat16(), layer.weight.bfloat16()).float() + layer.bias
    assert out.dtype == torch.float32
    assert torch.equal(out, lowp)
    assert not torch.equal(out, exact)  # it really took the bf16 path
    torch.testing.assert_close(out, exact, rtol=0.05, atol=0.3)


@pytest.mark.parametrize("q_len", [GEMM_MIN_ROWS + 1, 200])
def test_bf16_attention_of_a_fresh_prompt_is_close_to_fp32(q_len):
    torch.manual_seed(1)
    heads, kv_heads, dim, block = 6, 2, 32, 16
    q, k, v = (torch.randn(q_len, h, dim) for h in (heads, kv_heads, kv_heads))
    blocks = -(-q_len // block)
    meta = build_attention_metadata([q_len], [q_len], [list(range(blocks))], block)

    def run(dtype):
        cache = [torch.zeros(blocks, block, kv_heads, dim) for _ in range(2)]
        return paged_attention(q.to(dtype), k.to(dtype), v.to(dtype), cache[0], cache[1], meta,
                               dim ** -0.5), cache

    (exact, _), (lowp, cache) = run(torch.float32), run(torch.bfloat16)
    assert lowp.dtype == torch.bfloat16
    # The fp32 cache holds this step's bf16 K/V exactly (widened), as a later step reads them.
    assert torch.equal(cache[0].view(-1, kv_heads, dim)[:q_len], k.bfloat16().float())
    torch.testing.assert_close(lowp.float(), exact, rtol=0.05, atol=0.03)


def test_bf16_attention_of_a_chunk_after_a_cached_prefix_is_close_to_fp32():
    torch.manual_seed(2)
    heads, kv_heads, dim, block, prefix, q_len = 6, 2, 32, 16, 70, 50
    ctx = prefix + q_len
    q, k, v = (torch.randn(ctx, h, dim) for h in (heads, kv_heads, kv_heads))
    blocks = -(-ctx // block)
    first = build_attention_metadata([prefix], [prefix], [list(range(blocks))], block)
    chunk = build_attention_metadata([q_len], [ctx], [list(range(blocks))], block)

    def run(dtype):
        cache = [torch.zeros(blocks, block, kv_heads, dim) for _ in range(2)]
        paged_attention(q[:prefix], k[:prefix], v[:prefix], cache[0], cache[1], first,
                        dim ** -0.5)
        return paged_attention(q[prefix:].to(dtype), k[prefix:].to(dtype), v[prefix:].to(dtype),
                               cache[0], cache[1], chunk, dim ** -0.5)

    exact, lowp = run(torch.float32), run(torch.bfloat16)
    whole = paged_attention(q, k, v, *(torch.zeros(blocks, block, kv_heads, dim) for _ in range(2)),
                            build_attention_metadata([ctx], [ctx], [list(range(blocks))], block),
                            dim ** -0.5)[prefix:]
    torch.testing.assert_close(exact, whole, rtol=1e-4, atol=1e-5)  # the reference is causal
    assert lowp.dtype == torch.bfloat16
    torch.testing.assert_close(lowp.float(), exact, rtol=0.05, atol=0.03)


@pytest.mark.parametrize("with_kernels", [False, True])
def test_many_row_steps_keep_bf16_activations_and_few_row_steps_stay_fp32(with_kernels):
    """A float32 model under use_lowp_prefill: a step of more than GEMM_MIN_ROWS rows runs its
    linears on bf16 activations (bf16 in, bf16 out), a smaller step on fp32 ones; the final
    hidden states are fp32 either way."""
    from hearth.models.arch import ModelArch
    from hearth.models.families.llama.model import LlamaForCausalLM

    torch.manual_seed(3)
    kernels = load_cpu_kernels() if with_kernels else None
    if with_kernels and kernels is None:
        pytest.skip("no CPU kernel build is usable here")
    arch = ModelArch(architecture="llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5,
                     rope_theta=10000.0, max_position_embeddings=256, tie_word_embeddings=True)
    model = LlamaForCausalLM(arch)
    for p in model.parameters():
        p.data.normal_(0, 0.5)
    if kernels is not None:
        model.use_kernels(kernels)
    use_lowp_prefill(model, torch.bfloat16)
    seen = []
    proj = model.layers[1].mlp.down_proj
    proj.register_forward_hook(lambda m, args, out: seen.append((args[0].dtype, out.dtype)))
    block = 16

    def step(n):
        table = list(range(-(-n // block)))
        meta = build_attention_metadata([n], [n], [table], block)
        caches = [[torch.zeros(len(table), block, 2, 8) for _ in range(2)] for _ in range(2)]
        with torch.inference_mode():
            return model(torch.randint(0, 64, (n,)), torch.arange(n), meta, caches)[0]

    assert step(GEMM_MIN_ROWS + 1).dtype == torch.float32
    assert seen.pop() == (torch.bfloat16, torch.bfloat16)
    assert step(GEMM_MIN_ROWS).dtype == torch.float32
    assert seen.pop() == (torch.float32, torch.float32)

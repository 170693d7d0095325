"""Attention backends: which one a model gets, that models reach attention only through it, and
that the backends agree on the same paged step (dense GQA heads and MLA's latent rows)."""

import ast
from pathlib import Path

import pytest
import torch

from hearth.models.arch import MlaSpec, ModelArch, MoeSpec
from hearth.models.families.deepseek.model import DeepseekV3ForCausalLM
from hearth.models.families.llama.model import LlamaForCausalLM
from hearth.ops.attention import build_attention_metadata
from hearth.ops.attention_backends import (CpuKernelAttentionBackend, CudaAttentionBackend,
                                           TorchAttentionBackend, select_attention_backend)
from hearth.ops.cpu_kernels import CpuKernels
from tests.attention_steps import paged_attention
from tests.unit.test_cpu_kernels import (assert_attention_close, kernels,  # noqa: F401 (fixture)
                                         random_cache, takes_bf16_prefill_dots)

MODELS = Path(__file__).parents[2] / "hearth" / "models"
BUILD = CpuKernels("avx2")  # a handle only: selection never calls the kernels


@pytest.mark.parametrize("device, build, expected", [
    ("cpu", None, TorchAttentionBackend),
    ("cpu", BUILD, CpuKernelAttentionBackend),
    (torch.device("cpu"), BUILD, CpuKernelAttentionBackend),
    ("cuda", None, CudaAttentionBackend),
    ("cuda:1", None, CudaAttentionBackend),
    ("cuda", BUILD, CudaAttentionBackend),  # the CPU kernels never see CUDA tensors
])
def test_the_selector_picks_by_device_and_loaded_build(device, build, expected):
    backend = select_attention_backend(device, build)
    assert type(backend) is expected
    assert backend.kernels is (build if expected is CpuKernelAttentionBackend else None)


def test_the_selector_refuses_a_device_it_has_no_backend_for():
    with pytest.raises(ValueError, match="no attention backend for device meta"):
        select_attention_backend("meta")


def tiny_llama() -> ModelArch:
    return ModelArch("llama", vocab_size=32, hidden_size=32, intermediate_size=48, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64)


def tiny_deepseek() -> ModelArch:
    mla = MlaSpec(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
    moe = MoeSpec(num_experts=4, num_experts_per_tok=2, expert_intermediate_size=16,
                  dense_layers=(0,), scoring_func="sigmoid", topk_method="noaux_tc")
    return ModelArch("deepseek_v3", vocab_size=32, hidden_size=32, intermediate_size=48,
                     num_layers=2, num_heads=4, num_kv_heads=4, head_dim=12,
                     max_position_embeddings=64, moe=moe, mla=mla)


@pytest.mark.parametrize("make_model", [lambda: LlamaForCausalLM(tiny_llama()),
                                        lambda: DeepseekV3ForCausalLM(tiny_deepseek())])
def test_every_layer_attends_through_the_models_one_backend(make_model):
    model = make_model()
    assert [type(layer.self_attn.backend) for layer in model.layers] == [TorchAttentionBackend] * 2
    model.use_kernels(BUILD)
    backend = model.attn_backend
    assert type(backend) is CpuKernelAttentionBackend and backend.kernels is BUILD
    assert all(layer.self_attn.backend is backend for layer in model.layers)


ATTENTION_OPS = {"decode_attention", "prefill_attention", "amx_prefill_attention",
                 "rope_write_kv", "qk_norm_rope_write_kv"}


def test_models_name_no_attention_kernel_and_no_private_ops_name():
    found = []
    for path in sorted(MODELS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hearth.ops")
                    and any(alias.name.startswith("_") for alias in node.names)):
                found.append(f"{path.name}:{node.lineno} imports a private name")
            if (isinstance(node, ast.Attribute) and node.attr in ATTENTION_OPS
                    and isinstance(node.value, ast.Attribute) and node.value.attr == "ops"):
                found.append(f"{path.name}:{node.lineno} calls ops.{node.attr}")
    assert found == []


def test_models_call_kernels_only_through_named_methods():
    """No model file reaches a build's raw ops (`kernels.ops.x(...)`, `torch.ops.hearth`):
    each kernel is a method of `CpuKernels` that names its arguments, attention is the
    backend's."""
    found = []
    for path in sorted(MODELS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "ops" and not (
                    isinstance(node.value, ast.Name) and node.value.id == "hearth"):
                found.append(f"{path.relative_to(MODELS)}:{node.lineno} reads .ops")
    assert found == []


def mixed_step(gen, block_size: int, num_blocks: int):
    """A step with a prompt chunk after a cached prefix, a fresh prompt, a verify step of 4 and
    two decodes; block tables out of order."""
    query_lens, context_lens = [20, 18, 4, 1, 1], [50, 18, 40, 33, 1]
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for ctx in context_lens:
        tables.append(perm[used: used + -(-ctx // block_size)])
        used += len(tables[-1])
    return build_attention_metadata(query_lens, context_lens, tables, block_size)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("dim", [16, 64])  # the kernels' generic loops, their AVX-512 ones
def test_dense_backends_agree_on_a_mixed_paged_step(kernels, cache_dtype, dim):
    gen = torch.Generator().manual_seed(dim)
    heads, kv_heads, block_size, num_blocks = 6, 2, 16, 14
    meta = mixed_step(gen, block_size, num_blocks)
    kc = random_cache(gen, (num_blocks, block_size, kv_heads, dim), cache_dtype)
    vc = random_cache(gen, (num_blocks, block_size, kv_heads, dim), cache_dtype)
    q, k, v = (torch.randn(meta.num_tokens, h, dim, generator=gen)
               for h in (heads, kv_heads, kv_heads))
    outs, written = {}, []
    for backend in (TorchAttentionBackend(), CudaAttentionBackend(),
                    CpuKernelAttentionBackend(kernels)):
        k_cache, v_cache = kc.clone(), vc.clone()
        outs[backend.name] = paged_attention(q, k, v, k_cache, v_cache, meta, 0.25, backend)
        written.append(torch.cat([k_cache.view(torch.uint8), v_cache.view(torch.uint8)]))
    assert all(torch.equal(w, written[0]) for w in written)  # the same bytes in the cache
    assert_attention_close(outs["cpu_kernels"], outs["torch"],
                           takes_bf16_prefill_dots(kernels, cache_dtype, dim))  # its prompt chunks
    # the CUDA backend's torch math (one masked SDPA call after a prefix), on CPU tensors
    torch.testing.assert_close(outs["cuda"], outs["torch"], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_mla_backends_agree_on_latent_decodes_and_prefix_chunks(kernels, cache_dtype):
    gen = torch.Generator().manual_seed(9)
    heads, rank, rope, block_size, num_blocks = 4, 32, 8, 16, 14
    meta = mixed_step(gen, block_size, num_blocks)
    cache = random_cache(gen, (num_blocks, block_size, 1, rank + rope), cache_dtype)
    c, k_pe = torch.randn(meta.num_tokens, rank, generator=gen), torch.randn(
        meta.num_tokens, rope, generator=gen)
    q_lat = torch.randn(meta.num_short_tokens, heads, rank + rope, generator=gen)
    caches, decoded = [], []
    for backend in (TorchAttentionBackend(), CpuKernelAttentionBackend(kernels)):
        caches.append(cache.clone())
        backend.write_latent(c, k_pe, caches[-1], meta)
        decoded.append(backend.mla_decode(q_lat, caches[-1], meta, 0.2, rank))
    assert torch.equal(caches[0], caches[1])
    assert decoded[0].shape == (meta.num_short_tokens, heads, rank)
    torch.testing.assert_close(decoded[1], decoded[0], rtol=2e-5, atol=2e-5)
    # A prompt chunk over up-projected K/V: after a cached prefix, and with nothing cached.
    for q_len, ctx_len in ((20, 50), (18, 18)):
        q = torch.randn(heads, q_len, 24, generator=gen)
        k, v = (torch.randn(heads, ctx_len, 24, generator=gen) for _ in range(2))
        seen = torch.arange(ctx_len)[None, :] <= torch.arange(q_len)[:, None] + ctx_len - q_len
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=seen,
                                                                scale=0.2)
        for backend in (TorchAttentionBackend(), CudaAttentionBackend(),
                        CpuKernelAttentionBackend(kernels)):
            got = backend.mla_prefill(q, k, v, 0.2)
            torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)

"""Sliding-window, chunked-local and sink attention (`AttentionSpec`) through the backends,
against a plain reference: every query of every request, one at a time, over the whole context
in float64, the spec applied as written in its docstring."""

import pytest
import torch

from hearth.ops.attention import CAUSAL, AttentionSpec, build_attention_metadata
from hearth.ops.attention_backends import (CpuKernelAttentionBackend, CudaAttentionBackend,
                                           TorchAttentionBackend)
from tests.unit.test_attention_backends import mixed_step
from tests.unit.test_cpu_kernels import kernels, random_cache  # noqa: F401 (fixture)

HEADS, KV_HEADS, DIM, BLOCK_SIZE, NUM_BLOCKS = 6, 2, 16, 16, 14


def reference(q, k_cache, v_cache, meta, scale: float, spec: AttentionSpec) -> torch.Tensor:
    """Query by query: the keys j the spec lets position i see, softmax with the sink, float64."""
    out = torch.empty(q.shape, dtype=torch.float64)
    requests = list(zip(meta.prefill_query_starts, meta.prefill_query_lens,
                        meta.prefill_context_lens, [t.tolist() for t in meta.prefill_block_tables]))
    requests += [(row, 1, ctx, table) for row, ctx, table in zip(
        meta.decode_token_index.tolist(), meta.decode_context_lens, meta.decode_tables)]
    group = HEADS // KV_HEADS
    for start, q_len, ctx_len, table in requests:
        keys = k_cache[table].reshape(-1, KV_HEADS, DIM)[:ctx_len].double()
        values = v_cache[table].reshape(-1, KV_HEADS, DIM)[:ctx_len].double()
        for n in range(q_len):
            i = ctx_len - q_len + n
            seen = [j for j in range(i + 1)
                    if (spec.window is None or j > i - spec.window)
                    and (spec.chunk is None or j // spec.chunk == i // spec.chunk)]
            for h in range(HEADS):
                kv = h // group
                logits = (keys[seen, kv] @ q[start + n, h].double()) * scale
                weights = torch.exp(logits - logits.max())
                denom = weights.sum()
                if spec.sinks is not None:
                    denom = denom + torch.exp(spec.sinks[h].double() - logits.max())
                out[start + n, h] = (weights / denom) @ values[seen, kv]
    return out


SPECS = {
    "window 5": AttentionSpec(window=5),
    "window 1": AttentionSpec(window=1),
    "chunk 8": AttentionSpec(chunk=8),
    "chunk 16 + window 6": AttentionSpec(window=6, chunk=16),
    "sinks": AttentionSpec(sinks=torch.linspace(-2.0, 3.0, HEADS)),
    "window 7 + sinks": AttentionSpec(window=7, sinks=torch.linspace(1.0, -1.0, HEADS)),
    "chunk 8 + sinks": AttentionSpec(chunk=8, sinks=torch.full((HEADS,), 0.5)),
}


def step(seed: int, cache_dtype=torch.float32):
    """A mixed step (a chunk after a cached prefix, a fresh prompt, a verify step of 4, two
    decodes), its K/V already written, and its queries."""
    gen = torch.Generator().manual_seed(seed)
    meta = mixed_step(gen, BLOCK_SIZE, NUM_BLOCKS)
    k_cache = random_cache(gen, (NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, DIM), cache_dtype)
    v_cache = random_cache(gen, (NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, DIM), cache_dtype)
    q, k, v = (torch.randn(meta.num_tokens, h, DIM, generator=gen)
               for h in (HEADS, KV_HEADS, KV_HEADS))
    TorchAttentionBackend().write_kv(k, v, k_cache, v_cache, meta)
    return meta, k_cache, v_cache, q, k, v


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("backend", [TorchAttentionBackend(), CudaAttentionBackend()],
                         ids=lambda b: b.name)
def test_torch_backends_limit_keys_and_add_sinks_as_the_reference(backend, name):
    """Prompt chunks (after a prefix and fresh), a verify step and decodes under each spec;
    the CUDA backend's torch math on CPU tensors."""
    spec = SPECS[name]
    meta, k_cache, v_cache, q, k, v = step(3)
    got = backend.attend(q, k, v, k_cache, v_cache, meta, 0.3, spec)
    want = reference(q, k_cache, v_cache, meta, 0.3, spec)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_a_bf16_cache_and_bf16_queries_keep_the_spec():
    spec = AttentionSpec(window=9, sinks=torch.linspace(-1.0, 1.0, HEADS))
    meta, k_cache, v_cache, q, k, v = step(4, torch.bfloat16)
    got = TorchAttentionBackend().attend(q.bfloat16(), k, v, k_cache, v_cache, meta, 0.3, spec)
    assert got.dtype == torch.bfloat16
    want = reference(q.bfloat16().float(), k_cache.float(), v_cache.float(), meta, 0.3, spec)
    torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2)


def test_a_window_wider_than_every_context_is_plain_causal_attention():
    meta, k_cache, v_cache, q, k, v = step(5)
    backend = TorchAttentionBackend()
    wide = backend.attend(q, k, v, k_cache, v_cache, meta, 0.3, AttentionSpec(window=10_000))
    plain = backend.attend(q, k, v, k_cache, v_cache, meta, 0.3, CAUSAL)
    torch.testing.assert_close(wide, plain, rtol=1e-5, atol=1e-5)


def test_the_sink_takes_weight_from_every_key():
    """One key per query and a sink of the same logit: the output is half the value."""
    k_cache = torch.zeros(1, BLOCK_SIZE, KV_HEADS, DIM)
    v_cache = torch.zeros(1, BLOCK_SIZE, KV_HEADS, DIM)
    meta = build_attention_metadata([1], [1], [[0]], BLOCK_SIZE)
    v = torch.randn(1, KV_HEADS, DIM)
    k = torch.zeros(1, KV_HEADS, DIM)  # logit 0 against any query
    backend = TorchAttentionBackend()
    backend.write_kv(k, v, k_cache, v_cache, meta)
    out = backend.attend(torch.randn(1, HEADS, DIM), k, v, k_cache, v_cache, meta, 1.0,
                         AttentionSpec(sinks=torch.zeros(HEADS)))
    torch.testing.assert_close(out[0], 0.5 * v[0].repeat_interleave(HEADS // KV_HEADS, 0))


@pytest.mark.parametrize("name", ["window 5", "chunk 8 + sinks"])
def test_the_cpu_kernel_backend_serves_a_spec_through_the_torch_path(kernels, name):
    """The kernels have no window, chunk or sinks: the backend computes such a layer as the
    torch backend does, exactly, and plain layers still through its kernels."""
    spec = SPECS[name]
    meta, k_cache, v_cache, q, k, v = step(6)
    cpu = CpuKernelAttentionBackend(kernels)
    got = cpu.attend(q, k, v, k_cache, v_cache, meta, 0.3, spec)
    assert torch.equal(got, TorchAttentionBackend().attend(q, k, v, k_cache, v_cache, meta, 0.3,
                                                           spec))
    plain = cpu.attend(q, k, v, k_cache, v_cache, meta, 0.3)
    want = reference(q, k_cache, v_cache, meta, 0.3, CAUSAL)
    torch.testing.assert_close(plain.double(), want, rtol=1e-4, atol=1e-4)


def test_a_layer_with_a_spec_is_not_fused(kernels):
    """A decoder layer whose attention has a window keeps the module path (the fused decode
    kernels attend plainly)."""
    from hearth.models.arch import ModelArch
    from hearth.models.families.llama.model import LlamaForCausalLM
    from hearth.models.quant import quantize_q8_0
    from hearth.ops.cpu_kernels import QTYPE_IDS, pack_ggml

    arch = ModelArch("llama", vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=128)
    model = LlamaForCausalLM(arch)
    model.use_kernels(kernels)
    for layer in model.layers:
        for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                    layer.mlp.down_proj):
            lin.set_quantized(pack_ggml(QTYPE_IDS["q8_0"], quantize_q8_0(lin.weight.data)),
                              kernels)
    assert model.enable_fused_decode()
    model.layers[1].self_attn.spec = AttentionSpec(window=4)
    assert not model.enable_fused_decode()
    assert model.layers[0]._fused is not None and model.layers[1]._fused is None
    assert model._fused_all is None


@pytest.mark.parametrize("field", ["window", "chunk"])
def test_a_limit_below_one_is_refused(field):
    with pytest.raises(ValueError, match=f"attention {field} must be at least 1"):
        AttentionSpec(**{field: 0})

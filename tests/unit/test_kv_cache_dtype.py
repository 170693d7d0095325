"""--kv-cache-dtype: how `model`, `auto` and explicit choices resolve (int8 and fp8 included),
what the pool holds, and bad ones refused."""

from types import SimpleNamespace

import pytest
import torch

from hearth.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from hearth.engine import executor
from hearth.ops.cpu_kernels import available_variants


def kv_dtype(choice: str, **model) -> torch.dtype:
    config = EngineConfig(model=ModelConfig(quantization="none", **model),
                          cache=CacheConfig(kv_cache_dtype=choice))
    return executor.resolve_formats(config, checkpoint=None).kv_dtype


def test_model_is_the_model_dtype_and_explicit_choices_stand():
    assert kv_dtype("model", cpu_kernels="off") == torch.float32
    assert kv_dtype("model", dtype="bfloat16", cpu_kernels="off") == torch.bfloat16
    assert kv_dtype("float16", cpu_kernels="off") == torch.float16
    assert kv_dtype("bfloat16", cpu_kernels="off") == torch.bfloat16


def test_auto_is_bf16_only_where_the_kernels_read_it():
    assert kv_dtype("auto", cpu_kernels="off") == torch.float32  # the plain-torch path
    assert kv_dtype("auto", dtype="bfloat16", cpu_kernels="off") == torch.bfloat16
    if not available_variants():
        pytest.skip("no CPU kernel build is usable here")
    assert kv_dtype("auto") == torch.bfloat16


def test_the_engine_default_is_the_exact_model_dtype():
    assert CacheConfig().kv_cache_dtype == "model"


SCALED = [("int8", torch.int8), ("fp8", torch.float8_e4m3fn)]


@pytest.mark.parametrize("choice, dtype", SCALED)
def test_scaled_formats_resolve_on_any_path_and_mla_refuses_them(choice, dtype):
    assert kv_dtype(choice, cpu_kernels="off") == dtype  # torch path: correct, slower
    if available_variants():
        assert kv_dtype(choice) == dtype
    mla = SimpleNamespace(arch=SimpleNamespace(mla=object()))
    with pytest.raises(ValueError, match=f"kv_cache_dtype {choice}: not supported for MLA"):
        executor.resolve_formats(EngineConfig(model=ModelConfig(quantization="none",
                                                                cpu_kernels="off"),
                                              cache=CacheConfig(kv_cache_dtype=choice)), mla)


@pytest.mark.parametrize("choice, dtype", SCALED)
def test_scaled_pool_holds_32_17ths_of_the_bf16_tokens(choice, dtype):
    arch = SimpleNamespace(num_layers=30, kv_cache_layout=lambda tp: (2, 3, 64))
    cache = CacheConfig(kv_cache_memory_gb=1.0)
    bf16 = executor.num_kv_blocks(cache, arch, ParallelConfig(), torch.bfloat16)
    scaled = executor.num_kv_blocks(cache, arch, ParallelConfig(), dtype)
    assert scaled == 2**30 // (2 * 30 * 16 * 3 * 68)
    assert scaled / bf16 == pytest.approx(32 / 17, 1e-3)


def test_bad_choices_are_refused():
    with pytest.raises(ValueError, match="kv_cache_dtype: unsupported 'int4'"):
        kv_dtype("int4", cpu_kernels="off")

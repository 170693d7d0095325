"""--kv-cache-dtype: how `model`, `auto` and explicit choices resolve, and bad ones refused."""

import pytest
import torch

from hearth.config import CacheConfig, EngineConfig, ModelConfig
from hearth.engine import executor
from hearth.ops.cpu_kernels import available_variants


def kv_dtype(choice: str, **model) -> torch.dtype:
    config = EngineConfig(model=ModelConfig(quantization="none", **model),
                          cache=CacheConfig(kv_cache_dtype=choice))
    return executor.resolve_formats(config, checkpoint=None)[1]


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


def test_bad_choices_are_refused():
    with pytest.raises(ValueError, match="kv_cache_dtype: unsupported 'int4'"):
        kv_dtype("int4", cpu_kernels="off")

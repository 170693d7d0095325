"""The one place the engine gets its model executor from.

Contract the engine relies on (and nothing more): `execute(scheduler_output) ->
list[SampledToken]`, `num_blocks`, `close()`. With T = P = 1 that is the in-process
`ModelRunner` (no extra work on the single-process path); otherwise the driver of T x P rank
processes (`hearth.engine.parallel.executor.ParallelExecutor`). Only the ModelRunner exposes
`kv_cache`/`block_view` for KV transfer; the parallel executor raises a clear error there.

`RankFailedError` (re-exported here) is fatal: the engine must not retry a step after it.
"""

from __future__ import annotations

import torch

from hearth.config import CacheConfig, EngineConfig, ParallelConfig
from hearth.engine.parallel.layout import check_parallel_shape, kv_bytes_per_block_per_rank
from hearth.engine.runner import DTYPES, ModelRunner
from hearth.models.arch import ModelArch
from hearth.models.weights import build_model
from hearth.ops.distributed import RankFailedError

__all__ = ["RankFailedError", "make_executor", "num_kv_blocks"]


def num_kv_blocks(cache: CacheConfig, arch: ModelArch, parallel: ParallelConfig,
                  dtype: torch.dtype) -> int:
    """Blocks that fit the per-rank memory budget on the busiest rank; every rank allocates the
    same number, since block ids are shared."""
    if cache.num_blocks:
        return cache.num_blocks
    per_block = kv_bytes_per_block_per_rank(arch, parallel.tensor_parallel_size,
                                            parallel.pipeline_parallel_size, cache.block_size,
                                            dtype.itemsize)
    return max(4, int(cache.kv_cache_memory_gb * 2**30) // per_block)


def make_executor(config: EngineConfig, checkpoint):
    mc, pc = config.model, config.parallel
    if mc.dtype not in DTYPES:
        raise ValueError(f"dtype: unsupported {mc.dtype!r}; choose from {', '.join(DTYPES)}")
    dtype = DTYPES[mc.dtype]
    check_parallel_shape(checkpoint.arch, pc.tensor_parallel_size, pc.pipeline_parallel_size)
    num_blocks = num_kv_blocks(config.cache, checkpoint.arch, pc, dtype)
    if pc.world_size == 1:
        model = build_model(checkpoint, dtype, pc.device)
        return ModelRunner(model, num_blocks, config.cache.block_size, dtype, pc.device, mc.seed)
    from hearth.engine.parallel.executor import ParallelExecutor

    return ParallelExecutor(config, checkpoint, num_blocks)

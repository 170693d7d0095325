"""The one place the engine gets its model executor from.

Contract the engine relies on (and nothing more): `execute(StepCommand) -> SampleResult`
(hearth/engine/step.py), `num_blocks`, `num_micro_batches`, `close()`. With T = P = 1 that is the in-process
`ModelRunner` (no extra work on the single-process path); otherwise the driver of T x P rank
processes (`hearth.engine.parallel.parallel_executor.ParallelExecutor`). Only the ModelRunner exposes
`kv_cache`/`block_view` for KV transfer; the parallel executor raises a clear error there.

`RankFailedError` (re-exported here) is fatal: the engine must not retry a step after it.

`build_model_for` builds the single-process model alone (a `BuiltModel`); an engine given one
(`LLMEngine(..., prebuilt=)`) skips the build. Its weights are only read by a step, so several
engines of one process may share it (the tests build the real model once per format).
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from hearth.config import CacheConfig, EngineConfig, ParallelConfig
from hearth.engine import host_memory
from hearth.engine.parallel.distributed import RankFailedError
from hearth.engine.parallel.layout import check_parallel_shape, kv_bytes_per_block_per_rank
from hearth.engine.runner import DTYPES, KV_DTYPES, ModelRunner
from hearth.engine.step import Executor
from hearth.models.arch import ModelArch
from hearth.models.layers import QLINEAR_MAX_ROWS, use_lowp_prefill, use_lowp_prompt_gemms
from hearth.models.moe import use_lowp_expert_prompts
from hearth.models.quant import (FLOAT_GGML_TYPES, QUANTIZATIONS, attach_file_blocks,
                                 auto_quantization, quantize_model)
from hearth.models.weights import build_model
from hearth.ops import kv_quant
from hearth.ops.cpu_kernels import QTYPES, CpuKernels, load_cpu_kernels

__all__ = ["BuiltModel", "RankFailedError", "build_model_for", "make_executor", "num_kv_blocks",
           "resolve_formats"]

log = logging.getLogger("hearth.engine")


def num_kv_blocks(cache: CacheConfig, arch: ModelArch, parallel: ParallelConfig,
                  dtype: torch.dtype) -> int:
    """Blocks that fit the per-rank memory budget on the busiest rank; every rank allocates the
    same number, since block ids are shared."""
    if cache.num_blocks:
        return cache.num_blocks
    per_block = kv_bytes_per_block_per_rank(arch, parallel.tensor_parallel_size,
                                            parallel.pipeline_parallel_size, cache.block_size,
                                            dtype.itemsize, kv_quant.scale_bytes(dtype))
    return max(4, int(cache.kv_cache_memory_gb * 2**30) // per_block)


class Formats(NamedTuple):
    """What `resolve_formats` decided for this machine and checkpoint (no 'auto' left)."""

    dtype: torch.dtype  # the model's weights and activations
    kv_dtype: torch.dtype  # the KV cache (int8 / fp8 rows carry their scales)
    quantization: str  # none | gguf | q8_0 ... (hearth/models/quant.py)
    kernels: CpuKernels | None  # hearth's CPU kernel build, or None (plain torch)


class ModelFormats(NamedTuple):
    """What a built model was built for: a prebuilt model serves an engine only if equal."""

    dtype: torch.dtype
    quantization: str
    kernel_variant: str | None
    device: str
    prefill_dtype: torch.dtype


def resolve_formats(config: EngineConfig, checkpoint) -> Formats:
    """The formats with every 'auto' decided for this machine and checkpoint."""
    mc, cc, pc = config.model, config.cache, config.parallel
    if mc.dtype not in DTYPES:
        raise ValueError(f"dtype: unsupported {mc.dtype!r}; choose from {', '.join(DTYPES)}")
    dtype = DTYPES[mc.dtype]
    if cc.kv_cache_dtype not in ("auto", "model") and cc.kv_cache_dtype not in KV_DTYPES:
        raise ValueError(f"kv_cache_dtype: unsupported {cc.kv_cache_dtype!r}; "
                         f"choose from auto, model, {', '.join(KV_DTYPES)}")
    if (cc.kv_cache_dtype in KV_DTYPES and kv_quant.is_scaled(KV_DTYPES[cc.kv_cache_dtype])
            and checkpoint is not None and checkpoint.arch.mla is not None):
        raise ValueError(f"kv_cache_dtype {cc.kv_cache_dtype}: not supported for MLA models "
                         f"(DeepSeek's latent cache); use bfloat16 or model")
    kernels = None
    if (mc.cpu_kernels != "off" and pc.device == "cpu" and dtype == torch.float32
            and pc.world_size == 1):  # rank processes do not load the kernels yet
        kernels = load_cpu_kernels(mc.cpu_kernels)
    # KV "model": the model dtype, exact (the engine's default). "auto" (the CLI's default):
    # bfloat16 where the kernels read it in place, which halves the bytes a long-context decode
    # step reads (a 6k-context step 24.6 -> 20.9 ms engine alone on a quiet AMX Xeon) and the
    # pool's memory per token, at top-1 1.000 / KL 4e-5 against fp32 (docs/formats.md). It is not exact: rounding turns
    # summation-order noise between paths (one chunk or several, a prefix hit) into rounding
    # flips, so greedy output can drift from the fp32 reference.
    if cc.kv_cache_dtype == "model":
        kv_dtype = dtype
    elif cc.kv_cache_dtype == "auto":
        kv_dtype = torch.bfloat16 if kernels is not None else dtype
    else:  # int8 / fp8: rows of 8-bit values with a float32 scale each (hearth/ops/kv_quant.py)
        kv_dtype = KV_DTYPES[cc.kv_cache_dtype]
    quantization = mc.quantization
    if quantization == "auto":
        quantization = auto_quantization(checkpoint, kernels)
    elif quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization: unsupported {quantization!r}; "
                         f"choose from auto, {', '.join(QUANTIZATIONS)}")
    if quantization != "none" and kernels is None:
        raise ValueError(f"quantization {quantization!r} needs hearth's CPU kernels in float32 "
                         f"on the CPU (device={pc.device}, dtype={mc.dtype}, kernels "
                         f"{'off' if mc.cpu_kernels == 'off' else 'not built: run make setup'})")
    return Formats(dtype, kv_dtype, quantization, kernels)


PREFILL_DTYPES = ("float32", "bfloat16", "auto")
# `--prefill-dtype auto` on a CPU without AMX: a MoE model's quantized experts take bf16 copies
# for prompt GEMMs where bf16 GEMMs measure at least this much faster than fp32.
BF16_EXPERTS_SPEEDUP = 1.5


@functools.cache
def bf16_gemm_speedup() -> float:
    """fp32 time over bf16 time of one expert-prompt-sized GEMM ([256, 1024] x [1024, 512])
    on this CPU, best of 5 each (~20 ms, once per process)."""
    import time

    a = torch.randn(256, 1024)
    b = torch.randn(1024, 512)

    def best(x: torch.Tensor, y: torch.Tensor) -> float:
        torch.mm(x, y)
        times = []
        for _ in range(5):
            start = time.perf_counter()
            torch.mm(x, y)
            times.append(time.perf_counter() - start)
        return min(times)

    return best(a, b) / best(a.bfloat16(), b.bfloat16())


def amx_usable() -> bool:
    """Whether this process may run AMX tiles (the kernel grants the tile state; a CPU that
    lists amx_* in /proc/cpuinfo inside a VM that does not pass it through says no here)."""
    init = getattr(getattr(torch._C, "_cpu", None), "_init_amx", None)
    try:
        return bool(init and init())
    except RuntimeError:
        return False


def resolve_prefill_dtype(config: EngineConfig) -> torch.dtype:
    """The compute dtype of many-row GEMMs: the model dtype, or bfloat16 for a float32 model
    with --prefill-dtype bfloat16 (or auto where AMX runs)."""
    mc, pc = config.model, config.parallel
    if mc.prefill_dtype not in PREFILL_DTYPES:
        raise ValueError(f"prefill_dtype: unsupported {mc.prefill_dtype!r}; "
                         f"choose from {', '.join(PREFILL_DTYPES)}")
    dtype = DTYPES.get(mc.dtype, torch.float32)
    if dtype != torch.float32 or mc.prefill_dtype == "float32":
        return dtype
    if mc.prefill_dtype == "auto":
        return (torch.bfloat16 if pc.world_size == 1 and pc.device == "cpu" and amx_usable()
                else dtype)
    if pc.world_size != 1:
        raise ValueError("prefill_dtype bfloat16 is not yet supported with tensor/pipeline "
                         "parallelism")
    return torch.bfloat16


@dataclass(frozen=True)
class BuiltModel:
    """A single-process model with its weights loaded and, where the format asks, the CPU
    kernels and quantized decode weights attached: what `make_executor` would build."""

    model: torch.nn.Module
    checkpoint: object  # the Checkpoint it was built from
    formats: ModelFormats
    kernels: CpuKernels | None  # the build the model calls (its runner tunes their threads)


def _model_formats(config: EngineConfig, formats: Formats) -> ModelFormats:
    return ModelFormats(formats.dtype, formats.quantization,
                        formats.kernels.variant if formats.kernels else None,
                        config.parallel.device, resolve_prefill_dtype(config))


def build_model_for(config: EngineConfig, checkpoint) -> BuiltModel:
    """The model `make_executor(config, checkpoint)` runs with T = P = 1, built once."""
    if config.parallel.world_size != 1:
        raise ValueError("a prebuilt model serves one process (tensor/pipeline parallel size 1)")
    return _build(config, checkpoint, resolve_formats(config, checkpoint))


def _build(config: EngineConfig, checkpoint, formats: Formats) -> BuiltModel:
    """The single-process model for `formats`, what `resolve_formats` decided."""
    mc, pc = config.model, config.parallel
    dtype, kv_dtype, quantization, kernels = formats
    if pc.device == "cpu":
        host_memory.tune_malloc()

    def before_load(model) -> None:  # weights a GGUF stores in blocks stay only in blocks
        if kernels is not None:
            attach_file_blocks(model, checkpoint, quantization, kernels,
                               cache_dir=mc.weight_cache or None)

    model = build_model(checkpoint, dtype, pc.device, before_load=before_load)
    if kernels is not None:
        model.use_kernels(kernels)
        quantize_model(model, checkpoint, quantization, kernels)
        model.enable_fused_decode()
    if hasattr(checkpoint, "release_pages"):  # every weight is copied out of the file's map
        checkpoint.release_pages()
    prefill_dtype = resolve_prefill_dtype(config)
    if prefill_dtype != dtype:
        use_lowp_prefill(model, prefill_dtype)
        if not amx_usable():
            log.warning("prefill dtype %s without AMX: likely slower than float32",
                        str(prefill_dtype).removeprefix("torch."))
    elif (mc.prefill_dtype == "auto" and dtype == torch.float32 and pc.device == "cpu"
          and bf16_gemm_speedup() >= BF16_EXPERTS_SPEEDUP):
        # Without AMX `auto` keeps prompts in fp32 activations (bf16 attention and 17-32-row
        # batches lose on such CPUs), but where bf16 GEMMs still run well ahead of fp32
        # (AVX512-BF16 on an EPYC: 404 vs 176 GFLOP/s) a prompt step's GEMMs go bf16: a MoE
        # model's quantized experts on bf16 copies (their fp32 ones dropped), every other
        # linear with its input rounded and its output widened back (float weights keep a bf16
        # copy beside them, blocks-only ones decode bf16 tiles).
        if quantization != "none" and checkpoint.arch.moe is not None:
            experts = use_lowp_expert_prompts(model, torch.bfloat16)
            log.info("MoE experts of %d layers: prompt GEMMs in bfloat16 (fp32 copies dropped)",
                     experts)
        linears = use_lowp_prompt_gemms(model, torch.bfloat16)
        log.info("%d linear layers: GEMMs of steps over %d rows in bfloat16, activations float32",
                 linears, QLINEAR_MAX_ROWS)
    log.info("formats: weights %s (decode: %s, prefill: %s), KV cache %s, CPU kernels %s",
             mc.dtype, quantization, str(prefill_dtype).removeprefix("torch."),
             str(kv_dtype).removeprefix("torch."), kernels.variant if kernels else "off")
    return BuiltModel(model, checkpoint, _model_formats(config, formats), kernels)


# Resident bytes per stored byte of a GGUF tensor the kernels read in its own blocks, once packed
# (hearth/ops/csrc/qlinear.h): Q4_K's scales widen to bytes (4.625 / 4.5 bits), Q6_K's values
# to bytes (8.5 / 6.5625); the 32-element formats keep their size.
_PACKED_GROWTH = {12: 4.625 / 4.5, 14: 8.5 / 6.5625}
_Q8_0_BYTES_PER_VALUE = 34 / 32


def weight_bytes_estimate(checkpoint, quantization: str) -> int | None:
    """Resident bytes the built model's weights take, from a GGUF's header alone (None for
    other checkpoints): blocks-only tensors at their packed size, other block types at Q8_0's,
    float tensors as float32 (plus a Q8_0 decode copy of 2-D ones under a quantization). An
    estimate: DeepSeek's MLA projections, which keep float copies, count at their block size."""
    file = getattr(checkpoint, "file", None)
    if file is None or not hasattr(file, "tensors"):
        return None
    total = 0
    blocks = quantization.startswith("gguf")
    for info in file.tensors.values():
        values = math.prod(info.shape)
        if info.ggml_type in FLOAT_GGML_TYPES or quantization == "none":
            total += 4 * values
            if quantization != "none" and len(info.shape) >= 2:
                total += int(values * _Q8_0_BYTES_PER_VALUE)
        elif blocks and info.ggml_type in QTYPES:
            total += int(info.num_bytes * _PACKED_GROWTH.get(info.ggml_type, 1.0))
        elif blocks:
            total += int(values * _Q8_0_BYTES_PER_VALUE)
        else:  # q8_0 of a dequantized float copy
            total += int(values * (4 + _Q8_0_BYTES_PER_VALUE))
    return total


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (None where there is none)."""
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_fits(config: EngineConfig, checkpoint, formats: Formats, num_blocks: int) -> None:
    """Refuse, before anything is built, a model whose weights (estimated from a GGUF's header)
    and KV pool exceed the memory this machine has available, naming the figures: better than
    the OOM killer mid-load."""
    pc, cc = config.parallel, config.cache
    weights = weight_bytes_estimate(checkpoint, formats.quantization)
    available = available_memory_bytes()
    if weights is None or available is None or pc.device != "cpu":
        return
    kv = num_blocks * kv_bytes_per_block_per_rank(
        checkpoint.arch, pc.tensor_parallel_size, pc.pipeline_parallel_size, cc.block_size,
        formats.kv_dtype.itemsize, kv_quant.scale_bytes(formats.kv_dtype))
    if weights + kv > available:
        gib = 2 ** 30
        raise ValueError(
            f"model does not fit: its weights take ~{weights / gib:.1f} GiB ({formats.quantization} "
            f"formats) and the KV pool {kv / gib:.1f} GiB ({num_blocks} blocks), "
            f"{(weights + kv) / gib:.1f} GiB in all, but this machine has {available / gib:.1f} "
            f"GiB available; lower --kv-cache-memory-gb or use a smaller quantization")


def make_executor(config: EngineConfig, checkpoint,
                  prebuilt: BuiltModel | None = None) -> Executor:
    """`prebuilt`: a model from `build_model_for` with the same checkpoint and formats (else a
    ValueError); None builds one."""
    pc = config.parallel
    formats = resolve_formats(config, checkpoint)
    resolve_prefill_dtype(config)  # a bad or unsupported choice fails before anything is built
    check_parallel_shape(checkpoint.arch, pc.tensor_parallel_size,
                         pc.pipeline_parallel_size, pc.enable_expert_parallel)
    checkpoint.arch.check_block_size(config.cache.block_size)  # e.g. Llama 4's attention chunks
    num_blocks = num_kv_blocks(config.cache, checkpoint.arch, pc, formats.kv_dtype)
    if prebuilt is None:
        check_fits(config, checkpoint, formats, num_blocks)
    if pc.world_size == 1:
        if prebuilt is None:
            prebuilt = _build(config, checkpoint, formats)  # formats resolved once
        elif prebuilt.checkpoint is not checkpoint:
            raise ValueError("prebuilt model: built from another checkpoint")
        elif prebuilt.formats != _model_formats(config, formats):
            raise ValueError(f"prebuilt model: built for {prebuilt.formats}, this engine's "
                             f"formats are {_model_formats(config, formats)}")
        return ModelRunner(prebuilt.model, num_blocks, config.cache.block_size, formats.kv_dtype,
                           pc.device, config.model.seed, prebuilt.kernels)
    if prebuilt is not None:
        raise ValueError("a prebuilt model serves one process (tensor/pipeline parallel size 1)")
    if formats.quantization != "none" or formats.kv_dtype != formats.dtype:
        raise ValueError(f"quantization and a KV cache dtype other than the model's are not yet "
                         f"supported with tensor/pipeline parallelism (quantization "
                         f"{formats.quantization}, kv_cache_dtype {config.cache.kv_cache_dtype})")
    from hearth.engine.parallel.parallel_executor import ParallelExecutor

    return ParallelExecutor(config, checkpoint, num_blocks)

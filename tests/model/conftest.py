"""The real default model, opened once and built once per format for the model tests of a session.

Building the model (weights dequantized or repacked, kernels attached) is most of an engine's
start; engines of one process may share a built model because a step only reads its weights
(`hearth.engine.executor.BuiltModel`). Each engine still owns its KV cache, pool, scheduler and
sampler, so a test sees a fresh engine exactly as before. Tests make engines through `models`:
`models.llm(**overrides)` or `models.engine(config, **engine_kwargs)`.
"""

from __future__ import annotations

import gc

import pytest

from hearth.config import EngineConfig
from hearth.engine.engine import LLMEngine
from hearth.engine.executor import BuiltModel, build_model_for, make_executor
from hearth.engine.llm import LLM, make_engine_config
from hearth.models.loader import load_checkpoint

MODEL = "smollm2-135m-instruct"


# Built models kept at once (least recently used dropped first). Each holds its weights (~0.3-0.8
# GB for the default model's fp32 and packed forms); test_formats alone asks for ten settings.
# A test file's tests run together on one worker, so a few entries still hit.
MAX_BUILT = 3


class Models:
    """Built models of one checkpoint, one per (dtype, quantization, kernels, device) setting;
    at most MAX_BUILT kept."""

    def __init__(self, checkpoint) -> None:
        self.checkpoint = checkpoint
        self._built: dict[tuple, BuiltModel] = {}  # in order of last use

    def prebuilt(self, config: EngineConfig) -> BuiltModel | None:
        """The shared model for `config`'s formats (None with T x P ranks: they build their own)."""
        if config.parallel.world_size != 1:
            return None
        mc = config.model
        key = (mc.dtype, mc.quantization, mc.cpu_kernels, config.parallel.device, mc.prefill_dtype)
        built = self._built.pop(key, None)
        if built is None:
            while len(self._built) >= MAX_BUILT:
                self._built.pop(next(iter(self._built)))
            built = build_model_for(config, self.checkpoint)
        self._built[key] = built
        return built

    def config(self, **overrides) -> EngineConfig:
        return make_engine_config(MODEL, **overrides)

    def llm(self, **overrides) -> LLM:
        config = self.config(**overrides)
        return LLM(config=config, checkpoint=self.checkpoint, prebuilt=self.prebuilt(config))

    def engine(self, config: EngineConfig, **engine_kwargs) -> LLMEngine:
        return LLMEngine(config, self.checkpoint, prebuilt=self.prebuilt(config), **engine_kwargs)

    def executor(self, config: EngineConfig):
        return make_executor(config, self.checkpoint, self.prebuilt(config))


@pytest.fixture(scope="session")
def checkpoint():
    return load_checkpoint(MODEL)


@pytest.fixture(scope="session")
def models(checkpoint) -> Models:
    return Models(checkpoint)


@pytest.fixture(autouse=True)
def collect_engines():
    """An engine (its KV pool: ~1 GB for the default model) sits in reference cycles, so it is
    freed only by Python's cyclic collector, which may not run for many tests: test_formats
    alone grew a pytest worker to ~7.8 GB. Collect after each test, so what a test made is gone
    before the next one (and beside `make test`'s other worker, Ray's memory monitor stays quiet)."""
    yield
    gc.collect()

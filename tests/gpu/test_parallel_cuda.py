"""The CUDA/NCCL path of tensor and pipeline parallelism (skipped without CUDA).

With one GPU only the single-rank case runs: the parallel executor (NCCL world of 1, gloo
command channel, a StageShard on the GPU, sampling on the host) against the in-process runner.
The T x P parity tests need as many GPUs as ranks (NCCL refuses two ranks on one device), so on
a one-GPU machine they skip; they are the same comparisons as tests/model/test_parallel.py, on a
random model of a real shape built on the spot.
"""

from __future__ import annotations

import pytest
import torch

from hearth.config import EngineConfig
from hearth.engine.llm import LLM, make_engine_config
from hearth.engine.sampling_params import SamplingParams
from hearth.models.random_checkpoint import write_random_checkpoint

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = [[(31 * i + 7 * j) % 4000 + 5 for j in range(n)] for i, n in enumerate([9, 40, 130])]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
SETTINGS = dict(device="cuda", num_blocks=64, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    # Llama-like proportions, small enough to start quickly; 8 heads / 4 KV heads split 2 and 4.
    return str(write_random_checkpoint(tmp_path_factory.mktemp("gpu") / "m", num_layers=8,
                                       hidden_size=1024, num_heads=8, num_kv_heads=4,
                                       intermediate_size=2816, vocab_size=8192))


def generate(model_path: str, **parallel):
    llm = LLM(model_path, **SETTINGS, **parallel)
    try:
        return llm.generate(PROMPTS, GREEDY)
    finally:
        llm.engine.close()


def assert_same(want, got, tie: float = 1e-3) -> None:
    """Token for token, except after a reference near-tie (GPU sums are less reproducible)."""
    for w, g in zip(want, got):
        for i, (wt, gt) in enumerate(zip(w.token_ids, g.token_ids)):
            if wt != gt:
                assert w.logprobs[i].top[0][1] - w.logprobs[i].top[1][1] < tie
                break


@pytest.fixture(scope="module")
def reference(model_path):
    return generate(model_path)


def test_parallel_executor_single_rank_on_cuda(model_path, reference):
    from hearth.engine.parallel.parallel_executor import ParallelExecutor
    from hearth.models.loader import load_checkpoint

    config: EngineConfig = make_engine_config(model_path, **SETTINGS)
    llm = LLM(config=config)
    llm.engine.executor.close()
    # Same engine, the T x P executor in place of ModelRunner: one rank, NCCL world of one.
    llm.engine.executor = ParallelExecutor(config, load_checkpoint(model_path), num_blocks=64)
    try:
        assert llm.engine.executor.shard.kv_cache.is_cuda
        assert_same(reference, llm.generate(PROMPTS, GREEDY))
    finally:
        llm.engine.close()


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2), (2, 2), (4, 1)])
def test_tp_pp_equal_single_gpu(model_path, reference, tp, pp):
    if torch.cuda.device_count() < tp * pp:
        pytest.skip(f"needs {tp * pp} GPUs, found {torch.cuda.device_count()}")
    assert_same(reference, generate(model_path, tensor_parallel_size=tp,
                                    pipeline_parallel_size=pp))

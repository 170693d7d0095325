"""An engine given a prebuilt model (`LLMEngine(..., prebuilt=)`) behaves as one that builds its own.

Two engines alive at once share one model and each keeps its own KV cache and pool: greedy tokens
and logprobs equal a self-built engine's. A model built for other formats or from another
checkpoint, or offered to T x P ranks, is refused by name.
"""

from __future__ import annotations

import pytest

from hearth.engine.engine import LLMEngine
from hearth.engine.executor import build_model_for
from hearth.engine.llm import LLM, make_engine_config
from hearth.engine.sampling_params import SamplingParams
from hearth.models.loader import load_checkpoint
from hearth.models.random_checkpoint import write_random_checkpoint

PROMPTS = [[(5 * i + 3 * j) % 250 + 3 for j in range(n)] for i, n in enumerate([7, 19, 40])]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(write_random_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny", num_layers=2))


def generate(llm: LLM):
    out = llm.generate(PROMPTS, GREEDY)
    assert llm.engine.kv_pool_is_whole()
    return out


def assert_same(got, want) -> None:
    """Tokens exactly; logprobs to 1e-4 (a second run hits the prefix cache: other chunks)."""
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        assert max(abs(a.logprob - b.logprob) for a, b in zip(g.logprobs, w.logprobs)) < 1e-4


def test_engines_sharing_a_model_equal_one_that_builds_its_own(tiny, all_threads):
    # all_threads: a runner tunes its kernels' threads only where torch has more than one
    config = make_engine_config(tiny, num_blocks=6, max_num_batched_tokens=16)  # preempts
    want = generate(LLM(config=config))
    checkpoint = load_checkpoint(tiny)
    shared = build_model_for(config, checkpoint)
    a = LLM(config=config, checkpoint=checkpoint, prebuilt=shared)
    b = LLM(config=config, prebuilt=shared)  # the checkpoint comes with the model
    assert a.engine.executor.model is b.engine.executor.model is shared.model
    assert a.engine.executor.kv_cache is not b.engine.executor.kv_cache
    for runner in (a.engine.executor, b.engine.executor):  # they tune the threads the model reads
        if runner.thread_tuner is not None:
            assert runner.thread_tuner.threads is shared.kernels.threads
    assert_same(generate(a), want)
    assert_same(generate(b), want)
    assert_same(generate(a), want)  # after b ran on the same weights
    assert a.engine.counters.preemptions > 0


def test_a_prebuilt_model_for_other_formats_or_checkpoint_is_refused(tiny):
    config = make_engine_config(tiny, num_blocks=8)
    checkpoint = load_checkpoint(tiny)
    shared = build_model_for(config, checkpoint)
    with pytest.raises(ValueError, match="prebuilt model: built for"):
        LLMEngine(make_engine_config(tiny, num_blocks=8, dtype="bfloat16"), checkpoint,
                  prebuilt=shared)
    with pytest.raises(ValueError, match="prebuilt model: built from another checkpoint"):
        LLMEngine(config, load_checkpoint(tiny), prebuilt=shared)
    with pytest.raises(ValueError, match="serves one process"):
        LLMEngine(make_engine_config(tiny, num_blocks=8, pipeline_parallel_size=2), checkpoint,
                  prebuilt=shared)
    with pytest.raises(ValueError, match="serves one process"):
        build_model_for(make_engine_config(tiny, tensor_parallel_size=2), checkpoint)

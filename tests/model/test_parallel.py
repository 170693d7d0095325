"""Tensor and pipeline parallelism over gloo (real rank processes) give one process's outputs.

The engine above the executor is unchanged, so with the same settings everything it decides
(chunks, prefix-cache hits, preemptions) is identical; what is compared is what the ranks
compute: greedy tokens token for token and their logprobs, on a tiny random model (all shapes
of T x P, including replicated KV heads and uneven stages) and on the real default model
against transformers' golden outputs (P=2, T=3: T=2 cannot split its 9 heads, see
test_real_model_rejects_tp2). A divergence is accepted only at a reference near-tie (< 1e-4).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from hearth.engine.executor import RankFailedError
from hearth.engine.llm import LLM
from hearth.engine.sampling_params import SamplingParams
from hearth.models.random_checkpoint import write_random_checkpoint

TIE = 1e-4
SETTINGS = dict(num_blocks=16, max_num_batched_tokens=32)  # chunks, cache hits, preemption
PROMPTS = [[(7 * i + 3 * j) % 250 + 3 for j in range(n)]
           for i, n in enumerate([5, 12, 23, 34, 47, 70])]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
GOLDEN = json.loads((Path(__file__).parent / "golden" / "smollm2_greedy.json").read_text())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    # 4 heads / 2 KV heads: T=2 shards KV heads, T=4 replicates them; 4 layers: P=3 is uneven.
    return str(write_random_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny", num_layers=4,
                                       hidden_size=64, num_heads=4, num_kv_heads=2,
                                       intermediate_size=128, vocab_size=256))


def run_twice(llm: LLM, params=GREEDY):
    """The prompts once, then again (served from the prefix cache); closes the engine."""
    try:
        first = llm.generate(PROMPTS, params)
        second = llm.generate(PROMPTS, params)
        assert llm.engine.kv_pool_is_whole()
        return first + second, llm.engine.counters.preemptions
    finally:
        llm.engine.close()


@pytest.fixture(scope="module")
def reference(tiny):
    outs, preemptions = run_twice(LLM(tiny, **SETTINGS))
    assert preemptions > 0 and outs[-1].cached_tokens > 0  # the settings exercise both
    return outs, preemptions


def assert_same_greedy(want, got) -> None:
    for w, g in zip(want, got):
        assert (g.prompt_tokens, g.cached_tokens) == (w.prompt_tokens, w.cached_tokens)
        for i, (wt, gt) in enumerate(zip(w.token_ids, g.token_ids)):
            if wt != gt:
                margin = w.logprobs[i].top[0][1] - w.logprobs[i].top[1][1]
                assert margin < TIE, f"token {i}: {gt} != {wt} (reference margin {margin:.2e})"
                break
            assert abs(w.logprobs[i].logprob - g.logprobs[i].logprob) < 1e-4
        else:
            assert len(g.token_ids) == len(w.token_ids)


@pytest.mark.parametrize("tp, pp, micro_batches", [
    (2, 1, 0), (4, 1, 0),  # KV heads sharded; KV heads replicated (2 heads on 4 ranks)
    (1, 2, 0), (1, 2, 4), (1, 3, 0),  # micro-batches = stages; more than stages; uneven stages
    (2, 2, 0),
])
def test_tiny_model_greedy_equals_single_process(tiny, reference, tp, pp, micro_batches):
    llm = LLM(tiny, tensor_parallel_size=tp, pipeline_parallel_size=pp,
              num_micro_batches=micro_batches, **SETTINGS)
    assert llm.engine.executor.num_micro_batches == (micro_batches or pp)
    outs, preemptions = run_twice(llm)
    want, want_preemptions = reference
    assert preemptions == want_preemptions
    assert_same_greedy(want, outs)


def test_single_rank_parallel_executor_equals_model_runner(tiny, reference):
    # The T x P machinery with one rank (no peers): the path the one-GPU CUDA test runs.
    from hearth.engine.llm import make_engine_config
    from hearth.engine.parallel.parallel_executor import ParallelExecutor
    from hearth.models.loader import load_checkpoint

    config = make_engine_config(tiny, **SETTINGS)
    llm = LLM(config=config)
    llm.engine.executor = ParallelExecutor(config, load_checkpoint(tiny), SETTINGS["num_blocks"])
    outs, preemptions = run_twice(llm)
    assert preemptions == reference[1]
    assert_same_greedy(reference[0], outs)


def test_seeded_sampling_penalties_and_logprobs_equal_single_process(tiny):
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=12, ignore_eos=True,
                             logprobs=3, repetition_penalty=1.0 + 0.2 * (i % 2))
              for i in range(len(PROMPTS))]
    results = []
    for parallel in ({}, dict(tensor_parallel_size=2, pipeline_parallel_size=2)):
        llm = LLM(tiny, **SETTINGS, **parallel)
        try:
            results.append(llm.generate(PROMPTS, params))
        finally:
            llm.engine.close()
    for want, got in zip(*results):
        assert got.token_ids == want.token_ids
        for a, b in zip(want.logprobs, got.logprobs):
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            assert abs(a.logprob - b.logprob) < 1e-4


def assert_matches_golden(case: dict, got: list[int]) -> None:
    want, margins = case["output_ids"], case["top2_margins"]
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            assert margins[i] < TIE, f"{case['prompt']!r}: token {i} is {g}, reference {w}"
            return
    assert len(got) == len(want)


@pytest.mark.slow
def test_real_model_pp2_with_chunks_and_prefix_cache():
    params = SamplingParams(temperature=0.0, max_tokens=GOLDEN["num_new"], ignore_eos=True)
    llm = LLM("smollm2-135m-instruct", pipeline_parallel_size=2, max_num_batched_tokens=64)
    try:
        outs = llm.generate([c["prompt_ids"] for c in GOLDEN["cases"]], params)
        for case, out in zip(GOLDEN["cases"], outs):
            assert_matches_golden(case, out.token_ids)
        again = llm.generate([c["prompt_ids"] for c in GOLDEN["cases"][:3]], params)
        for case, out in zip(GOLDEN["cases"], again):
            assert out.cached_tokens == (len(case["prompt_ids"]) - 1) // 16 * 16 > 0
            assert_matches_golden(case, out.token_ids)
        assert llm.engine.kv_pool_is_whole()
    finally:
        llm.engine.close()


@pytest.mark.slow
def test_real_model_tp3():
    params = SamplingParams(temperature=0.0, max_tokens=GOLDEN["num_new"], ignore_eos=True)
    llm = LLM("smollm2-135m-instruct", tensor_parallel_size=3)
    try:
        outs = llm.generate([c["prompt_ids"] for c in GOLDEN["cases"]], params)
        for case, out in zip(GOLDEN["cases"], outs):
            assert_matches_golden(case, out.token_ids)
    finally:
        llm.engine.close()


def test_real_model_rejects_tp2_and_too_many_stages():
    # Checked before any process starts: SmolLM2-135M has 9 heads, 3 KV heads, 30 layers.
    with pytest.raises(ValueError, match="tensor parallel size 2 does not divide the model's "
                                         "num_heads=9, num_kv_heads=3; valid sizes: 1, 3"):
        LLM("smollm2-135m-instruct", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="pipeline parallel size 31 is larger than the "
                                         "model's 30 layers"):
        LLM("smollm2-135m-instruct", pipeline_parallel_size=31)


def test_shape_mismatch_at_load_names_the_rank_and_tensor(tiny, tmp_path):
    bad = Path(write_random_checkpoint(tmp_path / "bad", num_layers=4, hidden_size=64,
                                       num_heads=4, num_kv_heads=2, intermediate_size=128,
                                       vocab_size=256))
    weights = load_file(str(bad / "model.safetensors"))
    weights["model.layers.3.self_attn.o_proj.weight"] = weights[
        "model.layers.3.self_attn.o_proj.weight"][:, :60].contiguous()
    save_file(weights, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match=r"rank 1 \(stage 1, tp 0\): ValueError: shape mismatch "
                                         r"loading model.layers.3.self_attn.o_proj.weight: "
                                         r"checkpoint \(64, 60\), model expects \(64, 64\)"):
        LLM(str(bad), pipeline_parallel_size=2, num_blocks=16)


def test_killed_rank_fails_the_engine_naming_it(tiny):
    """A rank killed while requests are being generated: the next step fails with the rank and
    its exit code (the watchdog's report: the heartbeat could only say "stopped responding")."""
    llm = LLM(tiny, tensor_parallel_size=2, pipeline_parallel_size=2, num_blocks=256)
    executor = llm.engine.executor
    victim = executor.local_ranks.procs[3]
    step, num_steps = llm.engine.step, []

    def step_then_kill_after_three():
        outputs = step()
        num_steps.append(1)
        if len(num_steps) == 3:
            os.kill(victim.pid, signal.SIGKILL)
        return outputs

    llm.engine.step = step_then_kill_after_three
    try:
        with pytest.raises(RankFailedError, match=r"rank 3 \(stage 1, tp 1\) died "
                                                  r"\(exit code -9\)"):
            llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=5000,
                                                 ignore_eos=True))
        assert len(num_steps) >= 3  # it was generating when the rank died
        assert all(p.poll() is not None for p in executor.local_ranks.procs.values())
        with pytest.raises(RankFailedError, match="rank 3"):  # and on every later step
            step()
    finally:
        llm.engine.close()


DRIVER = """
import os, sys
from hearth.engine.llm import LLM
llm = LLM(sys.argv[1], pipeline_parallel_size=3, num_blocks=16)
print(*llm.engine.executor.local_ranks.pids.values(), flush=True)
os.kill(os.getpid(), 9)
"""


def test_killed_driver_makes_every_rank_exit_naming_it(tiny):
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, tiny], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    pids = [int(p) for p in driver.stdout.readline().split()]
    assert len(pids) == 2
    # EOF once the ranks (which share the pipe) are gone; the timeout only guards a hang
    _, stderr = driver.communicate(timeout=120)
    # A rank closes the pipe on its way out a moment before it is gone from /proc (or a zombie):
    # wait for that (the deadline only guards a hang).
    deadline = time.monotonic() + 60
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert all(not _alive(pid) for pid in pids)
    for rank in (1, 2):
        assert f"hearth: rank {rank} (stage {rank}, tp 0): lost the rendezvous store" in stderr


# `hearth generate` as torchrun starts it (torchrun runs a script file, so a two-line one).
CLI = "import sys, hearth.cli as c; sys.exit(c.main())"


def test_torchrun_launch_equals_one_process(tiny, tmp_path):
    script = tmp_path / "hearth_cli.py"
    script.write_text(CLI)
    args = ["generate", "--model", tiny, "--max-tokens", "8", "--ignore-eos", "--json",
            "t5 t6 t7", "t9 t1"]
    alone = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True,
                           timeout=120)
    assert alone.returncode == 0, alone.stderr[-2000:]
    launched = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
         str(script), *args, "-tp", "2", "-pp", "2"],
        capture_output=True, text=True, timeout=300)
    assert launched.returncode == 0, launched.stderr[-2000:]
    assert launched.stdout == alone.stdout and alone.stdout.count("token_ids") == 2


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" not in f.read()
    except FileNotFoundError:
        return False

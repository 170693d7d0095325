"""ThreadTuner picks the thread count whose decode steps are faster, keeps exploring, and runs
prefill-sized steps on every thread unless one thread is measured faster (a fake clock: exact,
no timing)."""

import torch

from hearth.engine.thread_tuner import SMALL_STEP_TOKENS, ThreadTuner
from hearth.ops.cpu_kernels import KernelThreads


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def make_step(clock, threads, seconds_by_count):
    def step():
        clock.now += seconds_by_count[threads.count]
    return step


def test_picks_the_faster_count_and_keeps_exploring():
    clock, threads = FakeClock(), KernelThreads()
    tuner = ThreadTuner(threads, max_threads=2, explore_every=10, trial_steps=2, clock=clock)
    speeds = {1: 0.020, 2: 0.010}  # quiet machine: 2 threads faster
    used = []
    for _ in range(30):
        tuner.run(1, make_step(clock, threads, speeds))
        used.append(threads.count)
    assert used[:4] == [2, 2, 1, 1]  # the first round tries every candidate
    assert used[4:10] == [2] * 6
    assert used[10:14] == [2, 2, 1, 1]  # exploration every 10 steps
    speeds.update({2: 0.200})  # a neighbour now preempts one of the two threads
    for _ in range(30):
        tuner.run(1, make_step(clock, threads, speeds))
        used.append(threads.count)
    assert used[-5:] == [1] * 5


def test_prefill_sized_steps_use_every_thread_and_teach_nothing():
    clock, threads = FakeClock(), KernelThreads()
    tuner = ThreadTuner(threads, max_threads=2, clock=clock)
    tuner.run(SMALL_STEP_TOKENS + 1, make_step(clock, threads, {1: 1.0, 2: 1.0}))
    assert threads.count == 2 and tuner.cost == {}


def test_prefill_sized_steps_follow_the_decode_verdict_and_restore_torch_threads():
    clock, threads = FakeClock(), KernelThreads()
    tuner = ThreadTuner(threads, max_threads=2, explore_every=1000, trial_steps=1, clock=clock)
    saved = torch.get_num_threads()
    seen = []

    def large_step():
        seen.append((threads.count, torch.get_num_threads()))

    speeds = {1: 0.010, 2: 0.050}  # a busy neighbour: one thread decodes faster
    for _ in range(4):
        tuner.run(1, make_step(clock, threads, speeds))
    assert tuner.contended()
    tuner.run(SMALL_STEP_TOKENS + 1, large_step)
    assert seen[-1] == (1, 1) and torch.get_num_threads() == saved
    for _ in range(10):  # quiet again: two threads are measured faster
        tuner.record(1, 1, 0.020)
        tuner.record(2, 1, 0.010)
    assert not tuner.contended()
    tuner.run(SMALL_STEP_TOKENS + 1, large_step)
    assert seen[-1] == (2, saved)

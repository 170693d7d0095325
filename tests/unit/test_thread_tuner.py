"""ThreadTuner picks the thread count whose decode steps are faster, keeps exploring, and runs
prefill-sized steps on every thread unless one thread is measured faster (a fake clock: exact,
no timing)."""

import os

import torch

from hearth.engine.thread_tuner import (CONTENDED_MIN_SAMPLES, LOAD_CHECK_EVERY, SMALL_STEP_TOKENS, OthersCpu,
                                        ThreadTuner)
from hearth.ops.cpu_kernels import KernelThreads


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def quiet():
    return 0.0  # the other processes' CPU use, in cores: nothing else runs


def make_step(clock, threads, seconds_by_count):
    def step():
        clock.now += seconds_by_count[threads.count]
    return step


def test_picks_the_faster_count_and_keeps_exploring():
    clock, threads = FakeClock(), KernelThreads()
    tuner = ThreadTuner(threads, max_threads=2, explore_every=10, trial_steps=2, clock=clock,
                        others_cpu=quiet)
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
    tuner = ThreadTuner(threads, max_threads=2, clock=clock, others_cpu=quiet)
    tuner.run(SMALL_STEP_TOKENS + 1, make_step(clock, threads, {1: 1.0, 2: 1.0}))
    assert threads.count == 2 and tuner.cost == {}


def test_prefill_sized_steps_follow_the_decode_verdict_and_restore_torch_threads():
    clock, threads = FakeClock(), KernelThreads()
    tuner = ThreadTuner(threads, max_threads=2, explore_every=1000, trial_steps=3, clock=clock,
                        others_cpu=quiet)
    saved = torch.get_num_threads()
    seen = []

    def large_step():
        seen.append((threads.count, torch.get_num_threads()))

    speeds = {1: 0.010, 2: 0.050}  # a busy neighbour: one thread decodes faster
    for _ in range(8):  # a round of 3 steps per count (CONTENDED_MIN_SAMPLES), then the best
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


def test_one_slow_step_does_not_move_the_choice():
    """Behind `hearth serve` a 2-thread step now and then takes 3x its usual time (the HTTP
    process ran meanwhile); a moving average once turned that into ~50 steps on one thread."""
    clock, threads = FakeClock(), KernelThreads()
    tuner = ThreadTuner(threads, max_threads=2, explore_every=10, trial_steps=2, clock=clock,
                        others_cpu=quiet)
    speeds = {1: 0.015, 2: 0.010}
    used = []
    for step in range(40):
        hiccup = step in (8, 20)  # the step before an exploration, and one in the middle
        tuner.run(1, make_step(clock, threads, {**speeds, 2: 0.030} if hiccup else speeds))
        used.append(threads.count)
    assert used.count(1) == 2 * tuner.rounds  # the rounds' 1-thread trials, and nothing else
    assert not tuner.contended()


def test_rounds_that_confirm_the_choice_come_less_often_and_a_change_resets_them():
    clock, threads = FakeClock(), KernelThreads()
    tuner = ThreadTuner(threads, max_threads=2, explore_every=10, trial_steps=2,
                        max_explore_every=80, clock=clock, others_cpu=quiet)
    speeds = {1: 0.015, 2: 0.010}
    starts = []
    for step in range(1, 400):
        rounds = tuner.rounds
        tuner.run(1, make_step(clock, threads, speeds))
        if tuner.rounds > rounds:
            starts.append(step)
    assert starts == [1, 11, 31, 71, 151, 231, 311, 391]  # 10, 20, 40, 80, then 80 apart
    speeds[2] = 0.200  # a neighbour: the 2-thread steps are slow from now on
    used = []
    for _ in range(40):
        tuner.run(1, make_step(clock, threads, speeds))
        used.append(threads.count)
    assert tuner.contended() and used[-5:] == [1] * 5
    speeds[2] = 0.010  # quiet again: the next round finds it (after the choice changed,
    for _ in range(60):  # rounds came 10, then 20, then 40 steps apart)
        tuner.run(1, make_step(clock, threads, speeds))
        used.append(threads.count)
    assert not tuner.contended() and used[-5:] == [2] * 5


def test_a_neighbour_starting_or_stopping_starts_a_round_at_once():
    """The rounds have spread out on a quiet machine; the other processes' CPU use jumping by a
    core (read every LOAD_CHECK_EVERY steps) brings the next round forward, both ways."""
    clock, threads = FakeClock(), KernelThreads()
    load = [0.05]
    tuner = ThreadTuner(threads, max_threads=2, explore_every=10, trial_steps=2,
                        max_explore_every=1000, clock=clock, others_cpu=lambda: load[0])
    speeds = {1: 0.015, 2: 0.010}
    for _ in range(300):  # rounds at 1, 11, 31, 71, 151: the next would be at 311
        tuner.run(1, make_step(clock, threads, speeds))
    rounds = tuner.rounds
    load[0], speeds[2] = 1.0, 0.500  # a neighbour: 2-thread steps are slow now ...
    for _ in range(2 * LOAD_CHECK_EVERY):
        tuner.run(1, make_step(clock, threads, speeds))
    assert tuner.rounds > rounds and tuner.contended()  # ... and a round found it at once
    rounds = tuner.rounds
    for _ in range(300):  # the rounds spread out again, confirming one thread
        tuner.run(1, make_step(clock, threads, speeds))
    load[0], speeds[2] = 0.05, 0.010  # the neighbour stops
    used = []
    for _ in range(2 * LOAD_CHECK_EVERY):
        tuner.run(1, make_step(clock, threads, speeds))
        used.append(threads.count)
    assert not tuner.contended() and used[-5:] == [2] * 5


def test_others_cpu_reads_this_machine():
    probe = OthersCpu()
    sum(i * i for i in range(200_000))  # some CPU of our own, which must not count
    value = probe()
    assert value is None or 0.0 <= value <= (os.cpu_count() or 1)


def step_time(base: dict[int, float], threads: KernelThreads, num_tokens: int) -> float:
    """A step's time: far from proportional to its tokens (each extra one costs a quarter of a
    1-token step, as verify steps and small batches measured)."""
    return base[threads.count] * (1 + 0.25 * (num_tokens - 1))


def test_steps_of_different_sizes_are_compared_size_for_size():
    """Speculative decoding mixes 1-token steps with verify steps of up to 16 tokens. Compared per
    token, a 1-thread trial that landed on a 9-token step looked cheaper than the 2-thread
    1-token steps, and one thread won on a quiet machine (and prompts then ran on one thread)."""
    clock, threads = FakeClock(), KernelThreads()
    tuner = ThreadTuner(threads, max_threads=2, explore_every=10, trial_steps=2, clock=clock,
                        others_cpu=quiet)
    base = {1: 0.015, 2: 0.010}  # quiet: two threads are faster at every size
    sizes = [1, 1, 9, 9] + [1, 5, 1, 9, 2, 1, 16, 1] * 10  # the first round's 1-thread trials get 9
    used = []
    for n in sizes:
        def step(n=n):
            clock.now += step_time(base, threads, n)
        tuner.run(n, step)
        used.append(threads.count)
    assert used.count(1) == 2 * tuner.rounds  # one thread only in the rounds' trials
    assert not tuner.contended()
    assert all(tuner._best(n) == 2 for n in (1, 2, 5, 9, 16))
    base[2] = 0.100  # a neighbour preempts one of the two threads: one is faster at every size
    for n in sizes * 2:
        def step(n=n):
            clock.now += step_time(base, threads, n)
        tuner.run(n, step)
        used.append(threads.count)
    assert used[-8:] == [1] * 8 and tuner.contended()


def test_a_step_size_nobody_measured_uses_the_nearest_measured_one():
    clock, threads = FakeClock(), KernelThreads()
    tuner = ThreadTuner(threads, max_threads=2, explore_every=1000, clock=clock, others_cpu=quiet)
    for threads_count, n, seconds in ((1, 2, 0.010), (2, 2, 0.020), (1, 12, 0.050), (2, 12, 0.030)):
        tuner.record(threads_count, n, seconds)
    assert tuner.cost == {1: {2: 0.010, 12: 0.050}, 2: {2: 0.020, 12: 0.030}}
    assert tuner._best(1) == 1 and tuner._best(3) == 1  # nearest by ratio: 2
    assert tuner._best(9) == 2 and tuner._best(16) == 2  # 12
    assert not tuner.contended()  # prompts follow the largest decode-like steps' verdict
    assert tuner._best(0) == 1  # an empty step counts as one token


def test_a_neighbour_is_noticed_after_one_slow_step_and_before_a_prompt():
    """Reading the load only every LOAD_CHECK_EVERY steps could leave up to 16 steps of ~0.5-1 s
    each on two threads beside a neighbour that had just started, and its prompt on two threads;
    a step 3x slower than its count's median, and every prompt-sized step, read it at once."""
    clock, threads = FakeClock(), KernelThreads()
    load = [0.05]
    tuner = ThreadTuner(threads, max_threads=2, explore_every=10, trial_steps=2,
                        max_explore_every=1000, clock=clock, others_cpu=lambda: load[0])
    speeds = {1: 0.015, 2: 0.010}
    for _ in range(100):
        tuner.run(1, make_step(clock, threads, speeds))
    load[0], speeds[2] = 1.0, 0.500  # a neighbour starts between two decode steps
    used = []
    for _ in range(LOAD_CHECK_EVERY):
        tuner.run(1, make_step(clock, threads, speeds))
        used.append(threads.count)
    assert used.count(2) == 1 and tuner.contended()  # the one slow step, then one thread

    load[0], speeds[2] = 0.05, 0.010  # it stops; the neighbour's next start meets a prompt
    for _ in range(3 * LOAD_CHECK_EVERY):
        tuner.run(1, make_step(clock, threads, speeds))
    assert not tuner.contended()
    seen = []
    load[0] = 1.0
    clock.now += 1.0
    tuner.run(SMALL_STEP_TOKENS + 1, lambda: seen.append(threads.count))
    assert seen == [1]


def test_the_first_load_reading_spans_the_start_up_and_rules_nothing_out():
    """The first reading covers the time since the tuner was built, while the HTTP process was
    starting beside the engine: it must not put the first prompt on one thread."""
    clock, threads = FakeClock(), KernelThreads()
    readings = iter([1.5] + [0.05] * 100)
    tuner = ThreadTuner(threads, max_threads=2, clock=clock, others_cpu=lambda: next(readings))
    seen = []
    tuner.run(SMALL_STEP_TOKENS + 1, lambda: seen.append(threads.count))
    assert seen == [2] and not tuner.contended()


def test_a_small_win_of_one_thread_at_tiny_steps_leaves_prompts_on_every_thread():
    """On a fast quiet machine one thread won 1-token decode steps by a little (no barrier); the
    2k-token prompts behind `hearth serve` then ran on one thread at half speed (2026-12-02)."""
    clock, threads = FakeClock(), KernelThreads()
    tuner = ThreadTuner(threads, max_threads=2, explore_every=1000, trial_steps=1, clock=clock,
                        others_cpu=quiet)
    saved = torch.get_num_threads()
    seen = []
    for _ in range(4):
        tuner.run(1, make_step(clock, threads, {1: 0.0040, 2: 0.0045}))
    assert tuner._best(1) == 1  # decode steps still take the faster count
    assert not tuner.contended()
    tuner.run(SMALL_STEP_TOKENS + 1, lambda: seen.append((threads.count, torch.get_num_threads())))
    assert seen == [(2, saved)]
    for _ in range(4):  # a preempted second thread: a clear margin, and prompts follow it
        tuner.record(1, 1, 0.004)
        tuner.record(2, 1, 0.020)
    assert tuner.contended()


def test_one_slow_first_step_is_no_verdict_for_prompts():
    """A server's first 2-thread decode step (the warm-up request's) was 16x its 1-thread one:
    one pair of samples must not send the prompts after it to one thread."""
    clock, threads = FakeClock(), KernelThreads()
    tuner = ThreadTuner(threads, max_threads=2, clock=clock, others_cpu=quiet)
    tuner.record(2, 1, 0.129)
    tuner.record(1, 1, 0.008)
    assert not tuner.contended()
    seen = []
    tuner.run(SMALL_STEP_TOKENS + 1, lambda: seen.append(threads.count))
    assert seen == [2]
    for _ in range(CONTENDED_MIN_SAMPLES - 1):  # a measured verdict still counts
        tuner.record(2, 1, 0.129)
        tuner.record(1, 1, 0.008)
    assert tuner.contended()


def test_while_own_background_work_runs_decodes_take_one_thread_and_a_prompt_waits():
    """The KV pool's prefault thread right after a start: 2-thread decode steps beside it took
    136 ms against 8 ms on one thread. Decode-like steps run on one thread and teach nothing;
    a prompt waits for the thread to end, then runs on every thread."""
    import threading

    clock, threads = FakeClock(), KernelThreads()
    release = threading.Event()
    background = threading.Thread(target=release.wait, daemon=True)
    background.start()
    tuner = ThreadTuner(threads, max_threads=2, clock=clock, others_cpu=quiet,
                        background=background)
    speeds = {1: 0.008, 2: 0.136}
    for _ in range(6):
        tuner.run(1, make_step(clock, threads, speeds))
        assert threads.count == 1
    assert tuner.cost == {} and not tuner.contended()
    seen = []
    threading.Timer(0.05, release.set).start()
    tuner.run(SMALL_STEP_TOKENS + 1, lambda: seen.append((background.is_alive(), threads.count)))
    assert seen == [(False, 2)]
    speeds.update({2: 0.006})
    for _ in range(12):
        tuner.run(1, make_step(clock, threads, speeds))
    assert set(tuner.cost) == {1, 2} and threads.count == 2


def test_a_prompt_waits_for_background_work_only_so_long(monkeypatch):
    import threading

    from hearth.engine import thread_tuner

    monkeypatch.setattr(thread_tuner, "BACKGROUND_WAIT", 0.05)
    release = threading.Event()
    background = threading.Thread(target=release.wait, daemon=True)
    background.start()
    threads = KernelThreads()
    tuner = ThreadTuner(threads, max_threads=2, clock=FakeClock(), others_cpu=quiet,
                        background=background)
    seen = []
    tuner.run(SMALL_STEP_TOKENS + 1, lambda: seen.append((background.is_alive(), threads.count)))
    assert seen == [(True, 2)]
    tuner.run(1, lambda: seen.append(threads.count))
    assert seen[-1] == 1  # still running: decode-like steps stay on one thread
    release.set()
    background.join()

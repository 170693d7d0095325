"""Choose how many threads a decode step's kernels use, by measuring.

A parallel region ends at a barrier, so one thread that another process preempts (a busy
neighbour, the HTTP server, a tokenizer) holds up the whole op for its time slice: beside one
spinning process a 2-thread decode step took ~0.95 s against ~15 ms on one thread. Which count
is faster depends on what else runs, so it is measured. For decode-like steps (at most
SMALL_STEP_TOKENS tokens) the tuner keeps the median of the last few step times of each
candidate (1: the kernels run on the calling thread, no parallel region; all of torch's
threads) per step size, and runs the best at the size nearest the step's where every candidate
has been measured.

- Per step size, not per token: a step's time is far from proportional to its tokens (verify
  steps of 1 / 2 / 5 / 9 tokens took 4.7 / 5.7 / 8.9 / 15.2 ms; at 6k tokens of context the extra
  rows cost less still), so with speculative decoding a 1-thread trial that landed on a 9-token
  verify step looked ~3x cheaper per token than the 2-thread 1-token steps beside it. One
  thread then won on a quiet machine, and the prompt that followed ran on one thread: a 6k-token
  prefill behind `hearth serve` took 25.6 s against 13.7 s with drafts off (2026-12-02).
- A median, not a moving average: behind `hearth serve` one hiccup (a 2-thread step of 29 ms
  among ~10 ms ones) lifted the average above the 1-thread cost, and the next ~50 steps ran on
  one thread at ~15 ms each. One slow sample in three moves no median.
- Rounds: now and then it tries every candidate for a few steps, `explore_every` steps after
  the start and twice as long after each round that confirms the choice (up to
  `max_explore_every`), since a trial of the losing count is a slow step. A round that changes
  the choice, or steps that change it between rounds, reset the interval.
- Load: every LOAD_CHECK_EVERY steps, after a step SLOW_STEP times slower than its count's
  median at its size, and before every prompt-sized step, it reads how many cores' worth of
  CPU other processes used (`OthersCpu`, from /proc; at most every LOAD_MIN_INTERVAL s). A
  change of LOAD_CHANGE cores since the last reading that counted (a neighbour starting or
  stopping) drops the samples and starts a round at once; and while others keep LOAD_BUSY
  cores or more busy, no count above the cores left free is run or tried (each such trial was
  a ~1 s step). Less than that (the HTTP process, a benchmark client) only
  counts through the measured step times. Before this, a stopped neighbour left decode on one
  thread until the next round.

The count goes to the kernels through `KernelThreads` (torch's own thread pool is left alone for
them: resizing it costs ~8 ms per switch). Results are the same whatever the count; only time
differs.

Prefill-sized steps are not measured (their cost per token depends on their shape), but they
follow the verdict of the largest decode-like steps, or the load rule: while one thread is the
choice there by CONTENDED_MARGIN, a large step runs on one thread, torch's GEMMs included (their barriers are
where a preempted thread stalls everything).
Engine alone, beside a process spinning on the other core, a 600-token prefill took 1.3-1.45 s
on one thread against 1.7-1.9 s on two (140 tokens: 0.35 against 0.53-0.74 s); on a quiet
machine the decode steps keep choosing every thread, and so do the large ones.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections import deque

import torch

SMALL_STEP_TOKENS = 16
LOAD_CHECK_EVERY = 16  # steps between reads of the other processes' CPU use
LOAD_CHANGE = 0.5  # cores' worth of change in it that starts a round
LOAD_BUSY = 0.9  # cores' worth of it from which only counts that fit the free cores run
LOAD_MIN_INTERVAL = 0.1  # seconds between two reads of it
SLOW_STEP = 3.0  # a step this many times its count's median at its size reads the load next
# Prompt-sized steps go to one thread only where one thread is this many times faster than
# every other count at the largest decode-like steps measured (a preempted thread's barrier
# waits cost ~5x and more; a quiet machine's difference at tiny steps is a few tens of percent).
CONTENDED_MARGIN = 1.5
# ... and only from at least this many step times of every count there: a server's first
# 2-thread decode step (the warm-up request's) took 129 ms against 8 ms for the next 1-thread
# one, and on that one pair every 2k-token prompt after it ran on one thread, at half speed
# (no decode steps came between the prompts to correct it; 2026-12-03).
CONTENDED_MIN_SAMPLES = 3
# Seconds a prompt waits at most for the KV pool's prefault thread (~0.5 s per GB here).
BACKGROUND_WAIT = 2.0


class OthersCpu:
    """Cores' worth of CPU that processes other than this one used since the last call, from
    /proc/stat and /proc/self/stat (None where they cannot be read: not Linux)."""

    def __init__(self) -> None:
        self._last = self._read()

    @staticmethod
    def _read() -> tuple[int, int, int] | None:
        try:
            with open("/proc/stat") as f:
                fields = [int(v) for v in f.readline().split()[1:]]
            with open("/proc/self/stat") as f:
                own = f.read().rsplit(")", 1)[1].split()
        except (OSError, ValueError, IndexError):
            return None
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return sum(fields), sum(fields) - idle, int(own[11]) + int(own[12])

    def __call__(self) -> float | None:
        now = self._read()
        last, self._last = self._last, now
        if now is None or last is None or now[0] <= last[0]:
            return None
        cores = os.cpu_count() or 1
        return max(0.0, (now[1] - last[1]) - (now[2] - last[2])) * cores / (now[0] - last[0])


class ThreadTuner:
    def __init__(self, threads, max_threads: int | None = None, explore_every: int = 64,
                 trial_steps: int = 2, window: int = 3, max_explore_every: int = 512,
                 clock=time.perf_counter, others_cpu=None, background=None) -> None:
        """`threads`: the KernelThreads the kernels read; `window`: samples per candidate and
        step size whose median is its cost; `others_cpu`: a callable giving the other
        processes' CPU use since its last call, in cores (default OthersCpu(); None from it
        is ignored); `background`: this process's own background work that holds a core
        for a while (the KV pool's prefault thread, a `threading.Thread`): while it runs,
        decode-like steps run on one thread and teach nothing, and a prompt waits for it."""
        self.threads = threads
        self._background = background
        self.candidates = sorted({1, max_threads or torch.get_num_threads()})
        self.explore_every, self.trial_steps = explore_every, trial_steps
        self.clock = clock
        self._samples: dict[int, dict[int, deque]] = {}  # threads -> step size -> seconds
        self._window = window
        self.steps = 0
        self._trial: list[int] = []
        self.max_explore_every = max(explore_every, max_explore_every)
        self._interval = explore_every
        self._next_round = 1  # the step at which the next exploration round starts
        self._round_from: int | None = None  # the choice when the running round started
        self._in_round = False
        self._round_to: int | None = None  # the choice the last finished round came to
        self.rounds = 0
        self._others_cpu = others_cpu if others_cpu is not None else OthersCpu()
        self._round_load: float | None = None  # the others' CPU use, the last reading that counted
        self._load_read_at: float | None = None  # clock() at the last reading
        self._slow_step = False

    @property
    def cost(self) -> dict[int, dict[int, float]]:
        """threads -> {step size in tokens: median of its recent step times} (measured only)."""
        return {t: {n: statistics.median(s) for n, s in by_size.items()}
                for t, by_size in self._samples.items()}

    def _size_for(self, num_tokens: int, usable: list[int]) -> int | None:
        """The step size nearest `num_tokens` (by ratio) at which every usable count has
        samples; None where there is none."""
        sizes = set.intersection(*(set(self._samples.get(c, {})) for c in usable))
        if not sizes:
            return None
        num_tokens = max(1, num_tokens)
        return min(sizes, key=lambda n: (abs(math.log(n / num_tokens)), n))

    def _usable(self) -> list[int]:
        """The candidates worth running: while other processes keep LOAD_BUSY cores busy,
        none with more threads than the cores left free, since its barriers would wait out the
        scheduler's time slices (a 2-thread step beside a spinning process took ~0.95 s
        against ~15 ms on one thread): such a count is neither chosen nor tried."""
        load = self._round_load
        if load is None or load < LOAD_BUSY:  # a whole core taken: a neighbour, not our clients
            return self.candidates
        free = max(1, int((os.cpu_count() or 1) - load + 1 - LOAD_BUSY))
        return [c for c in self.candidates if c <= free] or self.candidates[:1]

    def _best(self, num_tokens: int = 1) -> int | None:
        usable = self._usable()
        size = self._size_for(num_tokens, usable)
        if size is None:
            return None
        return min(usable, key=lambda c: statistics.median(self._samples[c][size]))

    def choose(self, num_tokens: int = 1) -> int:
        """The count for the next decode-like step, of `num_tokens` tokens."""
        self.steps += 1
        n = num_tokens
        if self._in_round and not self._trial:  # the last round's trials are all recorded
            self._in_round = False
            confirmed = self._round_from is not None and self._best(n) == self._round_from
            self._interval = (min(2 * self._interval, self.max_explore_every) if confirmed
                              else self.explore_every)
            self._next_round += self._interval
            self._round_to = self._best(n)
        elif not self._in_round and self._round_to is not None and self._best(n) != self._round_to:
            # Steps outside a round changed the choice (a neighbour came or went): look again
            # soon rather than up to max_explore_every steps from now.
            self._round_to = self._best(n)
            self._interval = self.explore_every
            self._next_round = min(self._next_round, self.steps + self.explore_every)
        if not self._in_round and (self.steps % LOAD_CHECK_EVERY == 0 or self._slow_step):
            self._check_load()
        if not self._trial and (self.steps >= self._next_round or self._best(n) is None):
            self._trial = [c for c in self._usable() for _ in range(self.trial_steps)]
            self._round_from, self._in_round = self._best(n), True
            self._next_round = self.steps
            self.rounds += 1
        if self._trial:
            return self._trial.pop()
        return self._best(n)

    def _check_load(self) -> None:
        """Read the other processes' CPU use (at most every LOAD_MIN_INTERVAL seconds: over a
        shorter span /proc's 10 ms ticks make it jump); a change of LOAD_CHANGE cores since the
        last reading that counted drops the samples and starts a round at the next step."""
        self._slow_step = False
        now = self.clock()
        if self._load_read_at is not None and now - self._load_read_at < LOAD_MIN_INTERVAL:
            return
        first, self._load_read_at = self._load_read_at is None, now
        load = self._others_cpu()
        if first:  # it spans the start-up, where the HTTP process loads beside the engine
            return
        if load is not None and self._round_load is None:
            self._round_load = load
        elif load is not None and abs(load - self._round_load) >= LOAD_CHANGE:
            self._round_load = load  # a neighbour came or went: measure afresh, now
            self._samples.clear()
            self._interval = self.explore_every
            self._next_round = self.steps

    def record(self, threads: int, num_tokens: int, seconds: float) -> None:
        by_size = self._samples.setdefault(threads, {})
        samples = by_size.setdefault(max(1, num_tokens), deque(maxlen=self._window))
        # A step far slower than this count's recent ones at its size (a neighbour may have
        # started): read the load at the next step outside a round instead of up to
        # LOAD_CHECK_EVERY steps on. Kept until read (a round's steps do not clear it).
        if samples and seconds > SLOW_STEP * statistics.median(samples):
            self._slow_step = True
        samples.append(seconds)

    def contended(self) -> bool:
        """Whether one thread is currently the choice for the largest decode-like steps
        (measured CONTENDED_MARGIN times faster than all of them there, or the only count the
        free cores allow)."""
        if len(self.candidates) < 2:
            return False
        if self._usable() == self.candidates[:1]:  # the load rule, whatever was measured
            return True
        usable = self._usable()
        size = self._size_for(SMALL_STEP_TOKENS, usable)
        if size is None:
            return False
        if any(len(self._samples[c][size]) < CONTENDED_MIN_SAMPLES for c in usable):
            return False
        cost = {c: statistics.median(self._samples[c][size]) for c in usable}
        one, rest = cost[self.candidates[0]], min(v for c, v in cost.items()
                                                  if c != self.candidates[0])
        # By a clear margin only: on a quiet machine one thread can win a tiny decode step by a
        # little (no barrier), and a 2k-token prompt then ran on one thread at half speed.
        return one * CONTENDED_MARGIN <= rest

    def run(self, num_tokens: int, fn):
        """Run `fn()` with the chosen count (decode-like steps) and learn from its time."""
        if self._background is not None:
            if not self._background.is_alive():
                self._background = None
            elif num_tokens <= SMALL_STEP_TOKENS:
                # Beside the prefault thread (~0.5 s per GB of KV pool right after a start) a
                # 2-thread decode step took 136 ms against 8 ms on one thread, and samples
                # taken then sent the prompts after it to one thread.
                return self._run_on_one_thread(fn)
            else:  # a prompt on one thread would take twice as long as the rest of the wait
                self._background.join(timeout=BACKGROUND_WAIT)  # (a huge pool: not for long)
                if not self._background.is_alive():
                    self._background = None
        if num_tokens > SMALL_STEP_TOKENS:
            self._check_load()  # a prompt beside a neighbour that came since the last decode
            if not self.contended():
                self.threads.count = self.candidates[-1]
                return fn()
            return self._run_on_one_thread(fn)
        self.threads.count = threads = self.choose(num_tokens)
        t0 = self.clock()
        result = fn()
        self.record(threads, num_tokens, self.clock() - t0)
        return result

    def _run_on_one_thread(self, fn):
        """`fn()` on one thread, torch's GEMMs included (their barriers are where a preempted
        thread stalls everything)."""
        self.threads.count = 1
        saved = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return fn()
        finally:
            torch.set_num_threads(saved)

"""Choose how many threads a decode step's kernels use, by measuring.

A parallel region ends at a barrier, so one thread that another process preempts (a busy
neighbour, the HTTP server, a tokenizer) holds up the whole op for its time slice: beside one
spinning process, 2-thread decode fell from ~80 to ~2 tokens/s. Which count is faster depends on
what else runs, so it is measured: for decode-like steps (at most SMALL_STEP_TOKENS tokens) the
tuner keeps a moving average of seconds per token for each candidate (1: the kernels run on the
calling thread, no parallel region; all of torch's threads), runs the best, and every
`explore_every` steps tries the others for a few steps. The count goes to the kernels through
`KernelThreads` (torch's own thread pool is left alone for them: resizing it costs ~8 ms per
switch). Results are the same whatever the count; only time differs.

Prefill-sized steps are not measured (their cost per token depends on their shape), but they
follow the decode steps' verdict: while one thread is measured faster, a large step runs on one
thread, torch's GEMMs included (their barriers are where a preempted thread stalls everything).
Engine alone, beside a process spinning on the other core, a 600-token prefill took 1.3-1.45 s
on one thread against 1.7-1.9 s on two (140 tokens: 0.35 against 0.53-0.74 s); on a quiet
machine the decode steps keep choosing every thread, and so do the large ones.
"""

from __future__ import annotations

import time

import torch

SMALL_STEP_TOKENS = 16


class ThreadTuner:
    def __init__(self, threads, max_threads: int | None = None, explore_every: int = 64,
                 trial_steps: int = 2, smoothing: float = 0.3, clock=time.perf_counter) -> None:
        """`threads`: the KernelThreads the kernels read."""
        self.threads = threads
        self.candidates = sorted({1, max_threads or torch.get_num_threads()})
        self.explore_every, self.trial_steps, self.smoothing = explore_every, trial_steps, smoothing
        self.clock = clock
        self.cost: dict[int, float] = {}  # threads -> moving average of seconds per token
        self.steps = 0
        self._trial: list[int] = []

    def choose(self) -> int:
        self.steps += 1
        if not self._trial and (self.steps % self.explore_every == 1
                                or len(self.cost) < len(self.candidates)):
            self._trial = [c for c in self.candidates for _ in range(self.trial_steps)]
        if self._trial:
            return self._trial.pop()
        return min(self.cost, key=self.cost.get)

    def record(self, threads: int, num_tokens: int, seconds: float) -> None:
        per_token = seconds / max(1, num_tokens)
        old = self.cost.get(threads)
        self.cost[threads] = per_token if old is None else old + self.smoothing * (per_token - old)

    def contended(self) -> bool:
        """Whether one thread is currently measured faster than all of them."""
        return (len(self.cost) == len(self.candidates) and len(self.candidates) > 1
                and min(self.cost, key=self.cost.get) == self.candidates[0])

    def run(self, num_tokens: int, fn):
        """Run `fn()` with the chosen count (decode-like steps) and learn from its time."""
        if num_tokens > SMALL_STEP_TOKENS:
            if not self.contended():
                self.threads.count = self.candidates[-1]
                return fn()
            self.threads.count = 1
            saved = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                return fn()
            finally:
                torch.set_num_threads(saved)
        self.threads.count = threads = self.choose()
        t0 = self.clock()
        result = fn()
        self.record(threads, num_tokens, self.clock() - t0)
        return result

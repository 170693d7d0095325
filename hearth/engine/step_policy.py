"""The step policy: how many prompt tokens a step may carry, and which waiting request goes next.

Both are pure functions of the queue state and a cost model, so the scheduler stays testable
without a clock:

- `prompt_token_budget`: with no request decoding, a step may fill the whole token budget
  (`max_num_batched_tokens`) with prompt tokens. While any request decodes, every token of its
  stream waits for the whole step, so the step's prompt tokens are bounded: by
  `max_prompt_tokens_while_decoding` if set, and by what fits the ITL target
  (`itl_target_ms`) at the measured cost per prompt token, never below MIN_PROMPT_TOKENS (a
  prompt must still progress when the decodes alone fill the target).
- `pick_next_waiting`: a waiting request whose prompt is mostly a cached prefix (an agent's
  next turn: a few new tokens over its session's history) is admitted before colder ones ahead
  of it; each request it passes counts a bypass, and a request passed `max_bypass` times is
  never passed again, so no cold prompt waits forever.
- `prompt_allowance`: one such warm turn per step is not held to the ITL bound: its new
  tokens (up to WARM_TURN_MAX_TOKENS) go in one step. Further warm turns wait for the next
  step: k turns one per step wait (k+1)/2 steps of one turn on average, all in one step k.
  Chunking a turn would keep a waiting agent waiting over several steps to shorten the others'
  next token by a little: on the agent replay (docs/benchmarks.md, issue 44) the bound on
  every prompt doubled the later turns' TTFT p50 (1.71 s against 0.84 s without it) on a
  2-core AVX2 EPYC, where one decode step of 8 streams already exceeds a 40 ms target. Cold
  prompts stay bounded.

`StepCost` is the cost model: the engine feeds it each step's prompt and draft tokens and seconds;
it keeps the median of the last few pure-decode step times and of the per-prompt-token cost
of steps that computed prompts (a median: one stall, a neighbour's time slice, moves no
median). Until it has measured enough it answers with a prior per CPU kind.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

from hearth.config import SchedulerConfig

MIN_PROMPT_TOKENS = 64  # prompt tokens a step may always carry, decodes or not
DRAFT_MARGIN = 1.25  # drafts must pay a quarter more than their rows cost (draft_break_even)
WARM_TURN_MAX_TOKENS = 1024  # a warm turn's new tokens that may pass the ITL bound in one step
MIN_COST_SAMPLE_TOKENS = 32  # a prompt step with fewer tokens says little about their cost
COST_WINDOW = 16  # recent samples kept of each kind
MIN_COST_SAMPLES = 3  # prompt-step samples before the measured cost replaces the prior
# Prompt tokens per step while decoding before anything is measured: AMX tiles run a float32
# model's prompt chunks in bfloat16 ~3x faster (docs/formats.md), so a step of twice the
# tokens takes about what the smaller one does without them.
PRIOR_PROMPT_TOKENS = {"amx": 512, "other": 256}


class StepCost:
    """Measured step times: the median pure-decode step and the median cost per prompt token."""

    def __init__(self, prior_prompt_tokens: int) -> None:
        self.prior_prompt_tokens = prior_prompt_tokens
        self.decode_seconds: deque[float] = deque(maxlen=COST_WINDOW)
        self.token_seconds: deque[float] = deque(maxlen=COST_WINDOW)  # per prompt token
        # (rows, seconds) of steps without prompt tokens (decodes and their drafts): the
        # per-row cost a draft adds, fitted over a window twice the others' (drafts need it)
        self.row_steps: deque[tuple[int, float]] = deque(maxlen=2 * COST_WINDOW)
        self._line: tuple[float, float] | None = None  # the last fit (rows may stop varying)

    def observe(self, num_prompt_tokens: int, num_drafts: int, seconds: float,
                num_decode_rows: int = 0) -> None:
        """One step that computed `num_prompt_tokens` prompt tokens (0: a pure decode step)
        beside its `num_decode_rows` decode rows and `num_drafts` draft tokens, in `seconds`."""
        if seconds <= 0:
            return
        if num_prompt_tokens == 0:
            if num_decode_rows:
                self.row_steps.append((num_decode_rows + num_drafts, seconds))
            if num_drafts == 0:  # a verify step is longer than the decode rows in a prompt step
                self.decode_seconds.append(seconds)
        elif num_prompt_tokens >= MIN_COST_SAMPLE_TOKENS:
            decode = self.decode_step_seconds()
            self.token_seconds.append(max(seconds - decode, 0.0) / num_prompt_tokens)

    def decode_step_seconds(self) -> float:
        return statistics.median(self.decode_seconds) if self.decode_seconds else 0.0

    def prompt_token_seconds(self) -> float:
        """The median measured cost of one prompt token (0.0 before any prompt step)."""
        return statistics.median(self.token_seconds) if self.token_seconds else 0.0

    def row_cost(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per row) of a step without prompt tokens: the least-squares
        line through the recent (rows, seconds); None until MIN_COST_SAMPLES steps of at least
        two row counts were seen; while the rows stop varying (nobody drafts), the last fit."""
        if len(self.row_steps) < MIN_COST_SAMPLES:
            return self._line
        rows = [r for r, _ in self.row_steps]
        mean_rows = sum(rows) / len(rows)
        spread = sum((r - mean_rows) ** 2 for r in rows)
        if spread == 0:
            return self._line
        mean_seconds = sum(t for _, t in self.row_steps) / len(rows)
        slope = sum((r - mean_rows) * (t - mean_seconds) for r, t in self.row_steps) / spread
        slope = max(slope, 0.0)
        self._line = max(mean_seconds - slope * mean_rows, 0.0), slope
        return self._line

    def decode_rows_seconds(self, num_decoding: int | None = None) -> float:
        """What `num_decoding` decode rows alone take: the fitted row line where there is one
        (steps that carry prompts teach the decode median nothing, so while prompts queue
        behind a growing batch the median is stale), else the median decode step."""
        line = self.row_cost() if num_decoding else None
        if line is None:
            return self.decode_step_seconds()
        return line[0] + line[1] * num_decoding

    def prompt_tokens_within(self, target_seconds: float, num_decoding: int | None = None) -> int:
        """Prompt tokens that fit in a step of `target_seconds` beside `num_decoding` decode
        rows (the prior until MIN_COST_SAMPLES prompt steps were measured)."""
        if len(self.token_seconds) < MIN_COST_SAMPLES:
            return self.prior_prompt_tokens
        per_token = self.prompt_token_seconds()
        room = target_seconds - self.decode_rows_seconds(num_decoding)
        if per_token <= 0:
            return 1 << 30
        return max(0, int(room / per_token))


def prompt_token_budget(config: SchedulerConfig, cost: StepCost | None,
                        num_decoding: int) -> int:
    """Prompt tokens one step may compute while `num_decoding` requests decode in it."""
    full = config.max_num_batched_tokens
    if num_decoding == 0:
        return full
    cap = full
    if config.max_prompt_tokens_while_decoding > 0:
        cap = min(cap, config.max_prompt_tokens_while_decoding)
    if config.itl_target_ms > 0 and cost is not None and \
            cost.decode_rows_seconds(num_decoding) < config.itl_target_ms / 1000:
        # (a target the decode rows alone already exceed cannot be met by holding prompts
        # back; it would only queue them: 32 streams on a 2-core AVX2 EPYC, decode steps of
        # ~0.3 s, went from 131 to 96 tok/s and ITL p90 124 -> 316 ms under the 40 ms bound)
        cap = min(cap, cost.prompt_tokens_within(config.itl_target_ms / 1000, num_decoding))
    return min(full, max(cap, MIN_PROMPT_TOKENS))


def prompt_allowance(prompt_budget: int, num_new_tokens: int, warm: bool) -> int:
    """Prompt tokens one request may compute in this step with `prompt_budget` left of the
    step's bound: a warm turn all its new tokens (up to WARM_TURN_MAX_TOKENS) whatever the
    bound says, any other request what is left of the bound."""
    if warm and num_new_tokens <= WARM_TURN_MAX_TOKENS:
        return max(prompt_budget, num_new_tokens)
    return max(prompt_budget, 0)


def draft_break_even(cost: StepCost | None, num_decoding: int) -> float:
    """The accepted tokens a draft token must bring, on average, to pay for its row: a step
    of n decodes gives n tokens in a + b*n seconds; k drafts bringing E accepted tokens give
    n + E in a + b*(n + k), which is more tokens per second only if E/k > b*n / (a + b*n) --
    times DRAFT_MARGIN, since a longer step also delays every stream's next chunk.
    0.0 (drafts are free) until the cost model has a line: on a memory-bound step b is small
    and drafts pay; on a compute-bound step (many rows, a CPU without matrix units) they must
    nearly all be accepted."""
    if cost is None or num_decoding <= 0:
        return 0.0
    line = cost.row_cost()
    if line is not None:
        fixed, per_row = line
    elif cost.decode_seconds and len(cost.token_seconds) >= MIN_COST_SAMPLES:
        # no line yet: a prompt token's cost stands in for a row (an over-estimate: its
        # attention spans a longer context), against the median decode step as it is
        per_row = cost.prompt_token_seconds()
        fixed = max(cost.decode_step_seconds() - per_row * num_decoding, 0.0)
    else:
        return 0.0
    step = fixed + per_row * num_decoding
    return min(1.0, DRAFT_MARGIN * per_row * num_decoding / step) if step > 0 else 0.0


@dataclass(frozen=True)
class WaitingView:
    """What admission order needs of one waiting request."""

    warm: bool  # its cached prefix covers at least half its prompt (a session's next turn)
    num_bypassed: int  # times a request behind it was admitted first


def is_warm(num_cached_tokens: int, num_tokens: int) -> bool:
    """A next turn: most of its prompt is already in the prefix cache."""
    return num_cached_tokens > 0 and num_cached_tokens * 2 >= num_tokens


def pick_next_waiting(queue: list[WaitingView], max_bypass: int) -> int:
    """Index of the waiting request to admit next: the first warm one, unless a request ahead
    of it has been passed `max_bypass` times already; else the head (0)."""
    for i, view in enumerate(queue):
        if view.warm:
            return i
        if view.num_bypassed >= max_bypass:
            return 0
    return 0

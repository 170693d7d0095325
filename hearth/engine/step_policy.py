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

    def observe(self, num_prompt_tokens: int, num_drafts: int, seconds: float) -> None:
        """One step that computed `num_prompt_tokens` prompt tokens (0: a pure decode step)
        beside its decode rows and `num_drafts` draft tokens, in `seconds`."""
        if seconds <= 0:
            return
        if num_prompt_tokens == 0:
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

    def prompt_tokens_within(self, target_seconds: float) -> int:
        """Prompt tokens that fit in a step of `target_seconds` beside the decode rows (the
        prior until MIN_COST_SAMPLES prompt steps were measured)."""
        if len(self.token_seconds) < MIN_COST_SAMPLES:
            return self.prior_prompt_tokens
        per_token = self.prompt_token_seconds()
        room = target_seconds - self.decode_step_seconds()
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
    if config.itl_target_ms > 0 and cost is not None:
        cap = min(cap, cost.prompt_tokens_within(config.itl_target_ms / 1000))
    return min(full, max(cap, MIN_PROMPT_TOKENS))


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

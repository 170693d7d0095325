"""Per-request sampling parameters, validated at construction.

Invalid values raise `RequestRejected` (a ValueError) naming the field, so the HTTP edge can
turn them into a 400 with `param` set.
"""

from __future__ import annotations

from dataclasses import dataclass

from hearth.engine.refusals import RequestRejected


@dataclass(frozen=True)
class GuidedSpec:
    """A constraint on the output, enforced by grammar-constrained decoding."""

    kind: str  # "json_schema" | "json_object" | "regex" | "grammar" (EBNF / Lark) | "structural_tag"
    value: str = ""  # the schema as JSON text, the regex, or the grammar text


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; 0: the sampled token's; k: plus top-k
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    guided: GuidedSpec | None = None

    def __post_init__(self) -> None:
        # Normalise lists to tuples so params stay hashable and immutable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        if not isinstance(self.stop_token_ids, tuple):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, why: str) -> None:
            raise RequestRejected(name, f"{name}: {why}")

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 100.0:
            bad("temperature", f"must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad("top_k", f"must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if not 0.0 < self.repetition_penalty <= 10.0:
            bad("repetition_penalty", f"must be in (0, 10], got {self.repetition_penalty}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            bad("logprobs", f"must be in [0, 20], got {self.logprobs}")
        if self.seed is not None and not isinstance(self.seed, int):
            bad("seed", f"must be an integer, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "every stop string must be a non-empty string")
        if len(self.stop) > 16:
            bad("stop", "at most 16 stop strings")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1

"""The reasoning formats by name: what `--reasoning-parser NAME` picks (vLLM's names).

One line per format (name -> parser class); a new format is a module beside think_parser.py and
a line here. `harmony` is another name for `openai_gptoss`.
"""

from __future__ import annotations

from typing import Protocol

from hearth.server.reasoning_parsers.harmony_parser import HarmonyReasoningParser
from hearth.server.reasoning_parsers.think_parser import (DeepSeekR1ReasoningParser,
                                                          KimiK2ReasoningParser,
                                                          Qwen3ReasoningParser, ReasoningEvent)


class ReasoningParser(Protocol):
    """What every format offers: `feed` / `finish` text -> ReasoningDelta | content str (in
    output order, independent of the text's split), and `is_reasoning_at` for the usage count.
    `content_parser`: the tool parser that must read the content even without tools (its
    markup), or None."""

    content_parser: str | None

    def feed(self, text: str) -> list[ReasoningEvent]: ...

    def finish(self) -> list[ReasoningEvent]: ...

    def is_reasoning_at(self, offset: int) -> bool: ...


PARSER_CLASSES: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
    "kimi_k2": KimiK2ReasoningParser,
    "openai_gptoss": HarmonyReasoningParser,  # vLLM's name for gpt-oss's harmony channels
    "harmony": HarmonyReasoningParser,
}
HARMONY_REASONING = "openai_gptoss"
REASONING_PARSERS = tuple(PARSER_CLASSES)


def check_reasoning_parser(name: str | None) -> None:
    """A clear error for a name no format has (`--reasoning-parser`, checked at startup)."""
    if name is not None and name not in PARSER_CLASSES:
        raise ValueError(f"--reasoning-parser: unknown {name!r}; one of "
                         f"{', '.join(REASONING_PARSERS)}")


def make_reasoning_parser(name: str) -> ReasoningParser:
    check_reasoning_parser(name)
    return PARSER_CLASSES[name]()

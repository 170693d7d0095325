"""The reasoning formats by name: what `--reasoning-parser NAME` picks (vLLM's names).

One line per format (name -> parser class); a new format is a module beside think_parser.py and
a line here.
"""

from __future__ import annotations

from hearth.server.reasoning_parsers.think_parser import (DeepSeekR1ReasoningParser,
                                                          Qwen3ReasoningParser, ThinkReasoningParser)

PARSER_CLASSES: dict[str, type[ThinkReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
}
REASONING_PARSERS = tuple(PARSER_CLASSES)


def check_reasoning_parser(name: str | None) -> None:
    """A clear error for a name no format has (`--reasoning-parser`, checked at startup)."""
    if name is not None and name not in PARSER_CLASSES:
        raise ValueError(f"--reasoning-parser: unknown {name!r}; one of "
                         f"{', '.join(REASONING_PARSERS)}")


def make_reasoning_parser(name: str) -> ThinkReasoningParser:
    check_reasoning_parser(name)
    return PARSER_CLASSES[name]()

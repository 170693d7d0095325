"""Incremental reasoning parsers: model output text -> reasoning and content, before tool calls.

    think_parser.py      ThinkReasoningParser: <think>...</think>; deepseek_r1, qwen3
    harmony_parser.py    HarmonyReasoningParser: gpt-oss's analysis channel; openai_gptoss
    reasoning_registry.py  name -> class; `--reasoning-parser NAME`

A choice's output goes through its reasoning parser first; the content it passes on is what the
tool parser (hearth/server/tool_parsers/) reads, so a call is never looked for inside reasoning.
"""

from hearth.api.reasoning import ReasoningDelta
from hearth.server.reasoning_parsers.harmony_parser import HarmonyReasoningParser
from hearth.server.reasoning_parsers.reasoning_registry import (HARMONY_REASONING, PARSER_CLASSES,
                                                             REASONING_PARSERS, ReasoningParser,
                                                             check_reasoning_parser,
                                                             make_reasoning_parser)
from hearth.server.reasoning_parsers.think_parser import ReasoningEvent, ThinkReasoningParser

__all__ = ["HARMONY_REASONING", "HarmonyReasoningParser", "PARSER_CLASSES", "REASONING_PARSERS",
           "ReasoningDelta", "ReasoningEvent", "ReasoningParser", "ThinkReasoningParser",
           "check_reasoning_parser", "make_reasoning_parser"]

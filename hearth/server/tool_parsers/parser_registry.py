"""The tool-call formats by name: what `--tool-call-parser NAME` picks and `auto` chooses from.

One line per format (name -> parser class); a new format is a module beside parser_base.py and
a line here. `auto` asks each format in AUTO_ORDER whether the model's chat template writes its
calls (a section format's marker tokens are the surest sign, so they go first), else hermes.
"""

from __future__ import annotations

from typing import Callable

from hearth.api.tool_calls import random_call_id
from hearth.server.tool_parsers.deepseek_parser import DeepSeekV3ToolParser, DeepSeekV31ToolParser
from hearth.server.tool_parsers.hermes_parser import HermesToolParser
from hearth.server.tool_parsers.kimi_k2_parser import KimiK2ToolParser
from hearth.server.tool_parsers.llama3_json_parser import Llama3JsonToolParser
from hearth.server.tool_parsers.openai_parser import OpenAIToolParser
from hearth.server.tool_parsers.parser_base import ToolParser
from hearth.server.tool_parsers.section_parser import SectionMarkup, SectionToolParser

PARSER_CLASSES: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "kimi_k2": KimiK2ToolParser,
    "deepseek_v3": DeepSeekV3ToolParser,
    "deepseek_v31": DeepSeekV31ToolParser,
    "openai": OpenAIToolParser,  # gpt-oss's harmony messages (vLLM's name)
}
TOOL_PARSERS = tuple(PARSER_CLASSES)
AUTO_ORDER = ("openai", "kimi_k2", "deepseek_v3", "deepseek_v31", "llama3_json")  # else hermes
# Formats whose markup is special tokens in their models' vocabularies: the output text must keep
# special tokens (the parser reads the markup and keeps it out of content).
SPECIAL_TOKEN_PARSERS = tuple(name for name, cls in PARSER_CLASSES.items() if cls.special_tokens)
# The section formats' markup, which the tool grammar writes (hearth/server/tool_grammar.py).
SECTION_MARKUPS: dict[str, SectionMarkup] = {
    name: cls.markup for name, cls in PARSER_CLASSES.items() if issubclass(cls, SectionToolParser)}


def make_tool_parser(name: str, make_call_id: Callable[[], str] = random_call_id) -> ToolParser:
    if name not in PARSER_CLASSES:
        raise ValueError(f"unknown tool-call parser {name!r}; one of {', '.join(TOOL_PARSERS)}")
    return PARSER_CLASSES[name](make_call_id)


def tool_parser_for_template(chat_template: str | None) -> str:
    """The format a model family's chat template writes (`--tool-call-parser auto`): harmony's
    channels -> openai, the markers of Kimi K2 or DeepSeek V3 / V3.1, Llama 3's headers ->
    llama3_json, else hermes."""
    if chat_template:
        for name in AUTO_ORDER:
            if PARSER_CLASSES[name].writes_template(chat_template):
                return name
    return "hermes"

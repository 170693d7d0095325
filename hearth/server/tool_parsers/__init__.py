"""Incremental tool-call parsers: model output text -> content and OpenAI tool-call deltas.

One module per format, a base they all build on, a registry that names them:

    parser_base.py         ToolParser, CallEmitter, Event, assemble: the shared rules
    call_scanner.py        CallScanner: one JSON call object, char by char
    hermes_parser.py       hermes       <tool_call>{...}</tool_call>  (Hermes, Qwen 2/2.5/3)
    llama3_json_parser.py  llama3_json  {"name": ..., "parameters": ...}; ...  (Llama 3.x)
    section_parser.py      SectionToolParser: calls in a section of marker tokens
    kimi_k2_parser.py      kimi_k2      (Kimi K2)
    deepseek_parser.py     deepseek_v3, deepseek_v31  (DeepSeek V3 / V3.1)
    openai_parser.py       openai       harmony messages to=functions.NAME  (gpt-oss)
    parser_registry.py     name -> class; `--tool-call-parser NAME` and `auto`

Formats import only parser_base (section formats also section_parser), never each other; the
names below are the package's public surface.
"""

from hearth.api.tool_calls import ToolCall, ToolCallDelta
from hearth.server.tool_parsers.parser_base import Event, ToolParser, assemble
from hearth.server.tool_parsers.parser_registry import (PARSER_CLASSES, SECTION_MARKUPS,
                                                        SPECIAL_TOKEN_PARSERS, TOOL_PARSERS,
                                                        make_tool_parser, tool_parser_for_template)
from hearth.server.tool_parsers.section_parser import SectionMarkup

__all__ = ["Event", "PARSER_CLASSES", "SECTION_MARKUPS", "SPECIAL_TOKEN_PARSERS", "SectionMarkup",
           "TOOL_PARSERS", "ToolCall", "ToolCallDelta", "ToolParser", "assemble",
           "make_tool_parser", "tool_parser_for_template"]

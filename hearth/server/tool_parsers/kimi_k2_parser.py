"""kimi_k2: Kimi K2's calls, in a section of marker tokens (section_parser.py reads them).

    text <|tool_calls_section_begin|>
         <|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{...}<|tool_call_end|>
         ... <|tool_calls_section_end|>

(Shown on several lines: the markers follow each other with nothing between them.) A call's
header `functions.f:N` is also its id, as the model's template writes it back in history.
"""

from __future__ import annotations

from hearth.server.tool_parsers.section_parser import SectionMarkup, SectionToolParser

KIMI_K2 = SectionMarkup(
    section_begin="<|tool_calls_section_begin|>", section_end="<|tool_calls_section_end|>",
    call_begin="<|tool_call_begin|>", header_end="<|tool_call_argument_begin|>",
    call_end="<|tool_call_end|>", separator="<|tool_call_argument_begin|>",
    name_prefix="functions.", name_suffix=":", numbered=True,
    other_section_begin="<|tool_call_section_begin|>", other_section_end="<|tool_call_section_end|>",
)


class KimiK2ToolParser(SectionToolParser):
    markup = KIMI_K2

    @classmethod
    def writes_template(cls, chat_template: str) -> bool:
        return KIMI_K2.section_begin in chat_template or KIMI_K2.call_begin in chat_template

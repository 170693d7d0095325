"""deepseek_v3, deepseek_v31: DeepSeek V3 / V3.1's calls, in a section of marker tokens
(section_parser.py reads them).

    deepseek_v3   text <｜tool▁calls▁begin｜>
                  <｜tool▁call▁begin｜>function<｜tool▁sep｜>f\\n```json\\n{...}\\n```
                  <｜tool▁call▁end｜> ... <｜tool▁calls▁end｜>
    deepseek_v31  text <｜tool▁calls▁begin｜>
                  <｜tool▁call▁begin｜>f<｜tool▁sep｜>{...}<｜tool▁call▁end｜> ... <｜tool▁calls▁end｜>

(Shown on several lines: the markers follow each other with nothing between them. DeepSeek's bars
are fullwidth U+FF5C and its spaces U+2581.) A call gets a random id. A template that fences the
arguments in ```json writes V3's calls, one that does not V3.1's.
"""

from __future__ import annotations

from hearth.server.tool_parsers.section_parser import SectionMarkup, SectionToolParser

_DEEPSEEK = dict(section_begin="<｜tool▁calls▁begin｜>", section_end="<｜tool▁calls▁end｜>",
                 call_begin="<｜tool▁call▁begin｜>", call_end="<｜tool▁call▁end｜>",
                 separator="<｜tool▁sep｜>")
DEEPSEEK_V3 = SectionMarkup(**_DEEPSEEK, name_prefix="function<｜tool▁sep｜>", name_suffix="\n",
                            header_end="```json", args_prefix="\n", args_suffix="\n```")
DEEPSEEK_V31 = SectionMarkup(**_DEEPSEEK, header_end="<｜tool▁sep｜>")


class DeepSeekV3ToolParser(SectionToolParser):
    markup = DEEPSEEK_V3

    @classmethod
    def writes_template(cls, chat_template: str) -> bool:
        return DEEPSEEK_V3.call_begin in chat_template and "```json" in chat_template


class DeepSeekV31ToolParser(SectionToolParser):
    markup = DEEPSEEK_V31

    @classmethod
    def writes_template(cls, chat_template: str) -> bool:
        return DEEPSEEK_V31.call_begin in chat_template and "```json" not in chat_template

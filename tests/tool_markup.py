"""Chat templates of our own that write the Kimi K2 and DeepSeek V3 / V3.1 tool-call markup, for the
unit tests (rendering round trips) and the e2e tests (a default model whose tokenizer has the
markers). ChatML turns, which the default model knows; the tools are listed in a system turn and an
assistant turn's calls are written exactly as the model writes them, so a parsed call sent back in
history renders as the text it was parsed from.
"""

from __future__ import annotations

from hearth.server.tool_parsers import SECTION_MARKUPS

# The formats' special tokens (DeepSeek's bars are U+FF5C, its spaces U+2581).
MARKERS = {
    "kimi_k2": ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                "<|tool_call_argument_begin|>", "<|tool_call_end|>"),
    "deepseek_v3": ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                    "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"),
}
MARKERS["deepseek_v31"] = MARKERS["deepseek_v3"]

# How each format writes one call `call` of an assistant turn (a Jinja expression or block). The
# DeepSeek ones concatenate the arguments as text, the way DeepSeek's own templates do.
_CALLS = {
    "kimi_k2": "<|tool_call_begin|>{{ call.id }}<|tool_call_argument_begin|>"
               "{{ call.function.arguments }}<|tool_call_end|>",
    "deepseek_v3": "{{ '<｜tool▁call▁begin｜>' + call.type + '<｜tool▁sep｜>' + call.function.name"
                   " + '\\n```json\\n' + call.function.arguments + '\\n```<｜tool▁call▁end｜>' }}",
    "deepseek_v31": "{{ '<｜tool▁call▁begin｜>' + call.function.name + '<｜tool▁sep｜>'"
                    " + call.function.arguments + '<｜tool▁call▁end｜>' }}",
}
_RESULTS = {
    "kimi_k2": "## Result of {{ message.tool_call_id }}\n{{ message.content }}",
    "deepseek_v3": "Result: {{ message.content }}",
    "deepseek_v31": "Result: {{ message.content }}",
}

_SKELETON = """\
{%- if tools -%}
<|im_start|>system
You can call these functions. Call one by writing its call in the tool section format.
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|im_end|>
{% endif -%}
{%- for message in messages -%}
{%- if message.role == 'tool' -%}
<|im_start|>user
@RESULT@<|im_end|>
{% elif message.role == 'assistant' and message.tool_calls -%}
<|im_start|>assistant
{{ message.content or '' }}@SECTION_BEGIN@{% for call in message.tool_calls %}@CALL@{% endfor %}\
@SECTION_END@<|im_end|>
{% else -%}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
{% endif -%}
"""


def chat_template(parser: str) -> str:
    """Our chat template writing `parser`'s markup (what `--tool-call-parser auto` detects)."""
    markup = SECTION_MARKUPS[parser]
    return (_SKELETON.replace("@SECTION_BEGIN@", markup.section_begin)
            .replace("@SECTION_END@", markup.section_end)
            .replace("@CALL@", _CALLS[parser]).replace("@RESULT@", _RESULTS[parser]))

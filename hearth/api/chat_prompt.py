"""Chat messages -> prompt text, through the model's own template.

Tools: when the template reads `tools` (Qwen 2.5/3, Llama 3.1+, Hermes, Kimi K2, DeepSeek
V3.1...), tools, assistant tool calls and tool results go to the template as transformers would
pass them (a call's arguments as an object that also reads as its JSON text: ArgumentsObject).
When it does not (SmolLM2, the ChatML fallback), hearth renders them itself in the Hermes format,
which the `hermes` parser reads back:

  * a system section listing the tools, appended to the first system message (or a new one):

        # Tools
        ... <tools>
        {"type": "function", "function": {"name": ..., "description": ..., "parameters": ...}}
        </tools>
        ... <tool_call>
        {"name": <function name>, "arguments": <arguments object>}
        </tool_call>

  * an assistant message's tool calls as `<tool_call>\\n{json}\\n</tool_call>` after its content;
  * tool results as a user turn of `<tool_response>\\n...\\n</tool_response>` blocks
    (consecutive results share one turn), which every template can render.

Content-part arrays are joined text parts; any other part type is a 400 (text-only server).
"""

from __future__ import annotations

import inspect
import json
from typing import Any

from hearth.engine.text.chat_template import render_chat_template
from hearth.api.protocol import ChatMessage, Tool, bad_request

TOOL_SECTION_HEADER = "# Tools"

TOOL_SECTION_TEMPLATE = """# Tools

You may call one or more functions to help with the user's request. The functions you can call are described as JSON objects inside <tools></tools> tags:
<tools>
{tools}
</tools>

To call a function, write a JSON object with its name and arguments inside <tool_call></tool_call> tags, one call per tag pair:
<tool_call>
{{"name": <function name>, "arguments": <arguments as a JSON object>}}
</tool_call>"""


def message_text(message: ChatMessage, index: int) -> str:
    """The text of a message's content (a string, or text parts joined by newlines)."""
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    texts = []
    for part_index, part in enumerate(message.content):
        if part.type != "text" or part.text is None:
            raise bad_request(
                f"content part type {part.type!r} is not supported (text only)",
                param=f"messages.{index}.content.{part_index}.type",
            )
        texts.append(part.text)
    return "\n".join(texts)


class ArgumentsObject(dict):
    """A call's arguments object that reads as its JSON text where a template treats it as text.

    Most templates write `arguments | tojson` (Qwen, Llama 3.1, Kimi K2) and need the object;
    DeepSeek V3 / V3.1 write `'<｜tool▁sep｜>' + arguments` and need the text. This is both: a
    dict to `tojson`, `items()` and `is mapping`; the client's own JSON text to `+`, `~` and
    `{{ }}`, so the call renders back exactly as the model wrote it."""

    def __init__(self, value: dict, text: str) -> None:
        super().__init__(value)
        self.text = text

    def __str__(self) -> str:
        return self.text

    def __add__(self, other: Any) -> Any:
        return self.text + other if isinstance(other, str) else NotImplemented

    def __radd__(self, other: Any) -> Any:
        return other + self.text if isinstance(other, str) else NotImplemented


def _arguments_value(arguments: str) -> Any:
    """Templates write `arguments | tojson` or concatenate the text: see ArgumentsObject."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
    return ArgumentsObject(value, arguments) if isinstance(value, dict) else value


def _template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the model's template expects them when it handles tools itself."""
    rendered = []
    for index, message in enumerate(messages):
        entry: dict[str, Any] = {
            "role": "system" if message.role == "developer" else message.role,
            "content": message_text(message, index),
        }
        if message.name is not None:
            entry["name"] = message.name
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        if message.reasoning_content is not None and message.role == "assistant":
            entry["reasoning_content"] = message.reasoning_content
        if message.tool_calls:
            entry["tool_calls"] = [
                {"id": call.id, "type": "function",
                 "function": {"name": call.function.name,
                              "arguments": _arguments_value(call.function.arguments)}}
                for call in message.tool_calls
            ]
        rendered.append(entry)
    return rendered


def tool_section(tools: list[Tool]) -> str:
    lines = "\n".join(json.dumps(tool.model_dump(exclude_none=True), ensure_ascii=False) for tool in tools)
    return TOOL_SECTION_TEMPLATE.format(tools=lines)


def _hermes_messages(messages: list[ChatMessage], tools: list[Tool] | None) -> list[dict[str, Any]]:
    """Messages with tools, calls and results written out in the Hermes format."""
    rendered: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        text = message_text(message, index)
        if message.role == "tool":
            block = f"<tool_response>\n{text}\n</tool_response>"
            if rendered and rendered[-1].get("_tool_results"):
                rendered[-1]["content"] += "\n" + block
            else:
                rendered.append({"role": "user", "content": block, "_tool_results": True})
            continue
        if message.role == "assistant" and message.tool_calls:
            calls = [
                "<tool_call>\n" + json.dumps(
                    {"name": call.function.name, "arguments": _arguments_value(call.function.arguments)},
                    ensure_ascii=False) + "\n</tool_call>"
                for call in message.tool_calls
            ]
            text = "\n".join(([text] if text else []) + calls)
        role = "system" if message.role == "developer" else message.role
        rendered.append({"role": role, "content": text})
    if tools:
        section = tool_section(tools)
        if rendered and rendered[0]["role"] == "system":
            rendered[0]["content"] = rendered[0]["content"] + "\n\n" + section
        else:
            rendered.insert(0, {"role": "system", "content": section})
    for entry in rendered:
        entry.pop("_tool_results", None)
    return rendered


def uses_builtin_tool_format(tokenizer: Any, messages: list[ChatMessage], tools: list[Tool] | None) -> bool:
    """True when hearth, not the template, writes tools and tool turns (so Hermes parsing)."""
    if getattr(tokenizer, "supports_tools_in_template", False):
        return False
    has_tool_turns = any(m.role == "tool" or m.tool_calls for m in messages)
    return bool(tools) or has_tool_turns


def reserved_template_kwargs(tokenizer: Any) -> set[str]:
    """Names `chat_template_kwargs` may not use: the render call's own arguments (those of the
    tokenizer's `apply_chat_template` and of the renderer under it), which the call sets."""
    names = {"self", "messages", "tools", "add_generation_prompt", "special_tokens"}
    for fn in (tokenizer.apply_chat_template, render_chat_template):
        names |= {p.name for p in inspect.signature(fn).parameters.values()
                  if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    return names


def check_template_kwargs(tokenizer: Any, template_kwargs: dict[str, Any] | None) -> None:
    clashes = sorted(set(template_kwargs or ()) & reserved_template_kwargs(tokenizer))
    if clashes:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(clashes)} (set by the request "
                          "itself)", param="chat_template_kwargs")


def render_chat_prompt(
    tokenizer: Any,
    messages: list[ChatMessage],
    tools: list[Tool] | None,
    add_generation_prompt: bool = True,
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    """The prompt text; raises APIError(400) for unsupported content or a template failure."""
    check_template_kwargs(tokenizer, template_kwargs)
    kwargs = dict(template_kwargs or {})
    if uses_builtin_tool_format(tokenizer, messages, tools):
        rendered, template_tools = _hermes_messages(messages, tools), None
    else:
        rendered = _template_messages(messages)
        template_tools = [t.model_dump(exclude_none=True) for t in tools] if tools else None
    try:
        return tokenizer.apply_chat_template(
            rendered, tools=template_tools, add_generation_prompt=add_generation_prompt, **kwargs)
    except ValueError as exc:  # ChatTemplateError: the template refused these messages
        raise bad_request(str(exc), param="messages") from None

"""Chat messages -> a harmony prompt (gpt-oss), written by hearth rather than a Jinja template.

    <|start|>system<|message|>IDENTITY
    Knowledge cutoff: 2024-06
    Current date: YYYY-MM-DD

    Reasoning: low|medium|high

    # Valid channels: analysis, commentary, final. Channel must be included for every message.
    [Calls to these tools must go to the commentary channel: 'functions'.]<|end|>
    [<|start|>developer<|message|># Instructions\\n\\nSYSTEM TEXT\\n\\n# Tools\\n\\n## functions\\n\\n
     namespace functions {...} // namespace functions<|end|>]
    <|start|>user<|message|>...<|end|>
    <|start|>assistant<|channel|>analysis<|message|>REASONING<|end|>       (see below)
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>ARGS<|call|>
    <|start|>functions.NAME to=assistant<|channel|>commentary<|message|>RESULT<|end|>
    <|start|>assistant<|channel|>final<|message|>ANSWER<|end|>
    <|start|>assistant                                                      (the generation prompt)

(Shown one message a line: nothing stands between them.) The client's system and developer
messages become the developer message's instructions (the system message is the format's own).
An assistant turn's reasoning is written back only after the last user message (the tool loop
in progress); earlier turns' reasoning is dropped, as gpt-oss was trained. A history ending in an
assistant answer (no generation prompt) ends it with <|return|>, as the model wrote it. Tools
are declared as TypeScript-like types, read from each function's JSON schema.
"""

from __future__ import annotations

import json
from datetime import date
from typing import Any

from hearth.api.chat_prompt import message_text, render_chat_prompt
from hearth.api.harmony import CALL, CHANNEL, CONSTRAIN, END, MESSAGE, RETURN, START
from hearth.api.protocol import ChatMessage, Tool, bad_request

MODEL_IDENTITY = "You are ChatGPT, a large language model trained by OpenAI."
KNOWLEDGE_CUTOFF = "2024-06"
REASONING_EFFORTS = ("low", "medium", "high")
DEFAULT_EFFORT = "medium"
TEMPLATE_KWARGS = ("model_identity", "reasoning_effort")  # what chat_template_kwargs may set
CHANNELS_LINE = ("# Valid channels: analysis, commentary, final. "
                 "Channel must be included for every message.")
TOOLS_CHANNEL_LINE = "Calls to these tools must go to the commentary channel: 'functions'."


def _message(header: str, body: str, end: str = END) -> str:
    return f"{START}{header}{MESSAGE}{body}{end}"


def system_message(effort: str, has_tools: bool, today: str, identity: str) -> str:
    lines = [identity, f"Knowledge cutoff: {KNOWLEDGE_CUTOFF}", f"Current date: {today}", "",
             f"Reasoning: {effort}", "", CHANNELS_LINE]
    if has_tools:
        lines.append(TOOLS_CHANNEL_LINE)
    return _message("system", "\n".join(lines))


def _type_of(schema: Any, indent: str = "") -> str:
    """A JSON schema as a TypeScript-like type."""
    if not isinstance(schema, dict):
        return "any"
    if "enum" in schema:
        return " | ".join(json.dumps(v, ensure_ascii=False) for v in schema["enum"]) or "never"
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            return " | ".join(_type_of(s, indent) for s in schema[key]) or "any"
    kind = schema.get("type")
    if isinstance(kind, list):
        return " | ".join(_type_of({**schema, "type": k}, indent) for k in kind) or "any"
    if kind == "string":
        return "string"
    if kind in ("integer", "number"):
        return "number"
    if kind == "boolean":
        return "boolean"
    if kind == "null":
        return "null"
    if kind == "array":
        item = _type_of(schema.get("items"), indent)
        return f"({item})[]" if " | " in item else f"{item}[]"
    if kind == "object" and isinstance(schema.get("properties"), dict):
        return _object_type(schema, indent)
    return "object" if kind == "object" else "any"


def _object_type(schema: dict, indent: str) -> str:
    required = set(schema.get("required") or ())
    lines = ["{"]
    for name, prop in schema["properties"].items():
        prop = prop if isinstance(prop, dict) else {}
        if prop.get("description"):
            lines += [f"{indent}// {line}" for line in str(prop["description"]).splitlines()]
        optional = "" if name in required else "?"
        line = f"{indent}{name}{optional}: {_type_of(prop, indent)},"
        if "default" in prop:
            line += f" // default: {json.dumps(prop['default'], ensure_ascii=False)}"
        lines.append(line)
    lines.append(indent + "}" if indent else "}")
    return "\n".join(lines)


def tool_namespace(tools: list[Tool]) -> str:
    """The `functions` namespace declaring the client's tools."""
    parts = ["## functions\n\nnamespace functions {\n"]
    for tool in tools:
        function = tool.function
        if function.description:
            parts += [f"// {line}" for line in function.description.splitlines()]
        params = function.parameters or {}
        if params.get("properties"):
            parts.append(f"type {function.name} = (_: {_type_of(params)}) => any;\n")
        else:
            parts.append(f"type {function.name} = () => any;\n")
    parts.append("} // namespace functions")
    return "\n".join(parts)


def developer_message(instructions: str, tools: list[Tool] | None) -> str | None:
    sections = []
    if instructions:
        sections.append(f"# Instructions\n\n{instructions}")
    if tools:
        sections.append("# Tools\n\n" + tool_namespace(tools))
    return _message("developer", "\n\n".join(sections)) if sections else None


def _call_message(name: str, arguments: str) -> str:
    header = f"assistant{CHANNEL}commentary to=functions.{name} {CONSTRAIN}json"
    return _message(header, arguments, CALL)


def _assistant_turn(message: ChatMessage, index: int, keep_reasoning: bool, last: bool) -> str:
    text = message_text(message, index)
    out = ""
    if keep_reasoning and message.reasoning_content:
        out += _message(f"assistant{CHANNEL}analysis", message.reasoning_content)
    if message.tool_calls:
        if text:  # a preamble before the calls
            out += _message(f"assistant{CHANNEL}commentary", text)
        for call in message.tool_calls:
            out += _call_message(call.function.name, call.function.arguments)
    elif text or not out:
        out += _message(f"assistant{CHANNEL}final", text, RETURN if last else END)
    return out


def check_effort(effort: str | None, param: str) -> str:
    if effort is None:
        return DEFAULT_EFFORT
    if effort not in REASONING_EFFORTS:
        raise bad_request(f"{param}: one of {', '.join(REASONING_EFFORTS)} (got {effort!r})",
                          param=param)
    return effort


def render_harmony_prompt(
    messages: list[ChatMessage],
    tools: list[Tool] | None,
    add_generation_prompt: bool = True,
    reasoning_effort: str | None = None,
    template_kwargs: dict[str, Any] | None = None,
    today: str | None = None,
) -> str:
    """The prompt text; raises APIError(400) for an unknown effort or template kwarg."""
    kwargs = dict(template_kwargs or {})
    unknown = sorted(set(kwargs) - set(TEMPLATE_KWARGS))
    if unknown:
        raise bad_request(f"chat_template_kwargs: the harmony format takes only "
                          f"{', '.join(TEMPLATE_KWARGS)} (got {', '.join(unknown)})",
                          param="chat_template_kwargs")
    effort = check_effort(reasoning_effort or kwargs.get("reasoning_effort"), "reasoning_effort")
    identity = str(kwargs.get("model_identity") or MODEL_IDENTITY)
    instructions = "\n\n".join(message_text(m, i) for i, m in enumerate(messages)
                               if m.role in ("system", "developer"))
    prompt = system_message(effort, bool(tools), today or date.today().isoformat(), identity)
    prompt += developer_message(instructions, tools) or ""
    last_user = max((i for i, m in enumerate(messages) if m.role == "user"), default=-1)
    call_names: dict[str, str] = {}  # tool_call_id -> the function it called
    for index, message in enumerate(messages):
        if message.role == "user":
            prompt += _message("user", message_text(message, index))
        elif message.role == "assistant":
            for call in message.tool_calls or ():
                call_names[call.id] = call.function.name
            last = index == len(messages) - 1 and not add_generation_prompt
            prompt += _assistant_turn(message, index, index > last_user, last)
        elif message.role == "tool":
            name = message.name or call_names.get(message.tool_call_id or "")
            if name is None:  # harmony writes a result as a message from functions.NAME
                raise bad_request(f"messages.{index}.tool_call_id: {message.tool_call_id!r} "
                                  "answers no earlier assistant tool call (a tool message must "
                                  "follow the call it answers, or give the function's name)",
                                  param=f"messages.{index}.tool_call_id")
            header = f"functions.{name} to=assistant{CHANNEL}commentary"
            prompt += _message(header, message_text(message, index))
    if add_generation_prompt:
        prompt += f"{START}assistant"
    return prompt


# ---- which renderer a server uses ----------------------------------------------------------

CHAT_FORMATS = ("auto", "template", "harmony")  # --chat-format


def template_is_harmony(chat_template: str | None) -> bool:
    """Whether a model's chat template writes harmony (gpt-oss's does: its channels)."""
    return bool(chat_template) and CHANNEL in chat_template and START in chat_template


def resolve_chat_format(name: str, chat_template: str | None) -> str:
    """`--chat-format`: auto -> harmony where the model's template writes it, else template."""
    if name not in CHAT_FORMATS:
        raise ValueError(f"--chat-format: unknown {name!r}; one of {', '.join(CHAT_FORMATS)}")
    if name == "auto":
        return "harmony" if template_is_harmony(chat_template) else "template"
    return name


def render_prompt(tokenizer: Any, chat_format: str, messages: list[ChatMessage],
                  tools: list[Tool] | None, add_generation_prompt: bool = True,
                  template_kwargs: dict[str, Any] | None = None,
                  reasoning_effort: str | None = None) -> str:
    """The prompt in the server's chat format (a resolved one: template | harmony)."""
    if chat_format == "harmony":
        return render_harmony_prompt(messages, tools, add_generation_prompt, reasoning_effort,
                                     template_kwargs)
    return render_chat_prompt(tokenizer, messages, tools, add_generation_prompt, template_kwargs)

"""Tool choice -> a grammar (xgrammar structural tag) in the format the tool parser reads.

    tool_choice "required"      exactly one call, of any tool
    tool_choice {function: f}   exactly one call of f
    tool_choice "auto"          free text; once the model opens a call, the name must be a tool
                                and the arguments must match its schema (a "triggered" tag)

Arguments always validate against the function's `parameters` schema (any object if none) and
are compact JSON (separators "," and ":", no other whitespace; see hearth.engine.guided).
The call text the grammar allows is exactly what `tool_parsers` parses:

    hermes       <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>
    llama3_json  {"name": "f", "parameters": {...}}
"""

from __future__ import annotations

import json

from hearth.engine.json_schemas import bounded_strings_as_patterns
from hearth.engine.sampling_params import GuidedSpec
from hearth.server.protocol import NamedToolChoice, Tool, bad_request

ANY_OBJECT = {"type": "object"}


def _call_tag(tool: Tool, parser: str) -> dict:
    try:
        schema = bounded_strings_as_patterns(tool.function.parameters or ANY_OBJECT)
    except (ValueError, TypeError, OverflowError) as exc:  # e.g. "minLength": "two"
        raise bad_request(f"tools: function {tool.function.name!r} has an invalid parameters "
                          f"schema: {exc}", param="tools") from None
    name = json.dumps(tool.function.name, ensure_ascii=False)
    # Compact arguments (no free whitespace): fewer tokens, and every key and `":` is forced.
    content = {"type": "json_schema", "json_schema": schema, "separators": [",", ":"]}
    if parser == "llama3_json":
        return {"type": "tag", "begin": '{"name": ' + name + ', "parameters": ', "content": content,
                "end": "}"}
    return {"type": "tag", "begin": '<tool_call>\n{"name": ' + name + ', "arguments": ',
            "content": content, "end": "}\n</tool_call>"}


def _trigger(parser: str) -> str:
    return '{"name": ' if parser == "llama3_json" else "<tool_call>"


def find_tool(tools: list[Tool], name: str) -> Tool:
    for tool in tools:
        if tool.function.name == name:
            return tool
    raise bad_request(f"tool_choice names function {name!r}, which is not in tools", param="tool_choice")


def tool_choice_guidance(
    tools: list[Tool] | None,
    tool_choice: str | NamedToolChoice | None,
    parallel_tool_calls: bool,
    parser: str,
) -> GuidedSpec | None:
    """The grammar for this tool choice, or None when the output is unconstrained."""
    if not tools or tool_choice == "none":
        if isinstance(tool_choice, NamedToolChoice) or tool_choice == "required":
            raise bad_request("tool_choice requires tools", param="tool_choice")
        return None
    if isinstance(tool_choice, NamedToolChoice):
        fmt = _call_tag(find_tool(tools, tool_choice.function.name), parser)
    elif tool_choice == "required":
        # Exactly one call: a small model asked for "one or more" keeps calling until
        # max_tokens cuts a call in half; parallel calls stay available under "auto".
        fmt = {"type": "or", "elements": [_call_tag(t, parser) for t in tools]}
    else:  # "auto" (the default when tools are given)
        fmt = {"type": "triggered_tags", "triggers": [_trigger(parser)],
               "tags": [_call_tag(t, parser) for t in tools],
               "stop_after_first": not parallel_tool_calls}
    return GuidedSpec("structural_tag", json.dumps({"type": "structural_tag", "format": fmt}))

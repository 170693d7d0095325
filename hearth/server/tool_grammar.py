"""Tool choice -> a grammar (xgrammar structural tag) in the format the tool parser reads.

    tool_choice "required"      exactly one call, of any tool
    tool_choice {function: f}   exactly one call of f
    tool_choice "auto"          free text; once the model opens a call, the name must be a tool
                                and the arguments must match its schema (a "triggered" tag)

Arguments always validate against the function's `parameters` schema (any object if none) and
are compact JSON (separators "," and ":", no other whitespace; see hearth.engine.guided.grammar).
The call text the grammar allows is exactly what `tool_parsers` parses:

    hermes       <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>
    llama3_json  {"name": "f", "parameters": {...}}
    openai       <|channel|>commentary to=functions.f <|constrain|>json<|message|>{...}<|call|>
                 (harmony; a forced call is the first message, with no analysis before it)
    kimi_k2, deepseek_v3, deepseek_v31
                 section_begin call... section_end, each call as its `SectionMarkup` writes it
                 (tool_parsers/section_parser.py); a Kimi K2 call's index (`functions.f:N`)
                 is the model's own numbering, up to 4 digits

Under "auto", a section format triggers on the section's begin marker: the section then holds
one call (any number with parallel_tool_calls) and its end marker; a call marker outside a
section (which the parser reads as a call) triggers one call.
"""

from __future__ import annotations

import json

from hearth.engine.guided.json_schemas import bounded_strings_as_patterns
from hearth.engine.sampling_params import GuidedSpec
from hearth.api.protocol import NamedToolChoice, Tool, bad_request
from hearth.server.tool_parsers import SECTION_MARKUPS, SectionMarkup

ANY_OBJECT = {"type": "object"}
CALL_INDEX_PATTERN = "(0|[1-9][0-9]{0,3})"


def _arguments(tool: Tool) -> dict:
    """The arguments' format: the function's schema, as compact JSON."""
    try:
        schema = bounded_strings_as_patterns(tool.function.parameters or ANY_OBJECT)
    except (ValueError, TypeError, OverflowError) as exc:  # e.g. "minLength": "two"
        raise bad_request(f"tools: function {tool.function.name!r} has an invalid parameters "
                          f"schema: {exc}", param="tools") from None
    # Compact arguments (no free whitespace): fewer tokens, and every key and `":` is forced.
    return {"type": "json_schema", "json_schema": schema, "separators": [",", ":"]}


def _call_tag(tool: Tool, parser: str) -> dict:
    name = json.dumps(tool.function.name, ensure_ascii=False)
    content = _arguments(tool)
    if parser == "llama3_json":
        return {"type": "tag", "begin": '{"name": ' + name + ', "parameters": ', "content": content,
                "end": "}"}
    return {"type": "tag", "begin": '<tool_call>\n{"name": ' + name + ', "arguments": ',
            "content": content, "end": "}\n</tool_call>"}


HARMONY_CALL_BEGIN = "<|channel|>commentary to=functions."  # what the openai parser reads


def _harmony_call(tool: Tool) -> dict:
    """A harmony call message after the prompt's `<|start|>assistant` (openai_parser.py)."""
    return {"type": "tag",
            "begin": HARMONY_CALL_BEGIN + tool.function.name + " <|constrain|>json<|message|>",
            "content": _arguments(tool), "end": "<|call|>"}


def _harmony_format(tools: list[Tool], tool_choice: str | NamedToolChoice,
                    parallel_tool_calls: bool) -> dict:
    """Forced: the call from the first token (no analysis before it). auto: free messages; a
    call message, once its header begins, names a tool and holds to its schema."""
    if isinstance(tool_choice, NamedToolChoice):
        return _harmony_call(find_tool(tools, tool_choice.function.name))
    calls = [_harmony_call(t) for t in tools]
    if tool_choice == "required":
        return {"type": "or", "elements": calls}
    return {"type": "triggered_tags", "triggers": [HARMONY_CALL_BEGIN], "tags": calls,
            "stop_after_first": not parallel_tool_calls}


def _trigger(parser: str) -> str:
    return '{"name": ' if parser == "llama3_json" else "<tool_call>"


def _section_call(tool: Tool, markup: SectionMarkup) -> dict:
    """One call inside a section: the header up to the arguments is forced (but Kimi's index)."""
    begin = markup.call_begin + markup.name_prefix + tool.function.name + markup.name_suffix
    content = _arguments(tool)
    if markup.numbered:
        content = {"type": "sequence", "elements": [
            {"type": "regex", "pattern": CALL_INDEX_PATTERN},
            {"type": "const_string", "value": markup.header_end + markup.args_prefix}, content]}
    else:
        begin += markup.header_end + markup.args_prefix
    return {"type": "tag", "begin": begin, "content": content,
            "end": markup.args_suffix + markup.call_end}


def _section_format(tools: list[Tool], tool_choice: str | NamedToolChoice,
                    parallel_tool_calls: bool, markup: SectionMarkup) -> dict:
    if isinstance(tool_choice, NamedToolChoice):
        calls = _section_call(find_tool(tools, tool_choice.function.name), markup)
    else:
        calls = {"type": "or", "elements": [_section_call(t, markup) for t in tools]}
        if tool_choice == "auto" and parallel_tool_calls:
            calls = {"type": "plus", "content": calls}
    section = {"type": "tag", "begin": markup.section_begin, "content": calls,
               "end": markup.section_end}
    if tool_choice != "auto":  # exactly one call (see tool_choice_guidance)
        return section
    # A call opened without its section is read as a call too, so it is held to the schema too.
    bare_calls = [_section_call(t, markup) for t in tools]
    return {"type": "triggered_tags", "triggers": [markup.section_begin, markup.call_begin],
            "tags": [section, *bare_calls], "stop_after_first": not parallel_tool_calls}


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
    if parser == "openai":
        fmt = _harmony_format(tools, tool_choice, parallel_tool_calls)
    elif parser in SECTION_MARKUPS:
        fmt = _section_format(tools, tool_choice, parallel_tool_calls, SECTION_MARKUPS[parser])
    elif isinstance(tool_choice, NamedToolChoice):
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

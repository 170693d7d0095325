"""The Anthropic Messages API's request, translated into the internal chat request, and its errors.

    POST /v1/messages {model, max_tokens, messages, system, tools, tool_choice, stop_sequences,
                       temperature, top_p, top_k, metadata, output_config.format, stream,
                       structured_outputs (vLLM's extension, as on Chat Completions)}
      -> a Chat Completions body (messages, tools, tool_choice, stop, sampling fields)

Content blocks: `text`; `tool_use` (assistant) -> a tool call; `tool_result` (user) -> a tool
message (content a string or text blocks; `is_error` prefixes the text with "Error: ", since chat
templates have no such flag); `thinking` (assistant) -> the turn's reasoning_content, which the
chat template keeps or drops (`redacted_thinking` is dropped: hearth cannot read it). Other block
types (image, document...) are a 400.
`tool_choice`: auto / any (-> required) / tool {name} / none; `disable_parallel_tool_use` ->
parallel_tool_calls false. Only custom (client) tools; no server tools.

Errors on these routes have Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`,
with the type chosen by HTTP status (`anthropic_error_body`).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field

from hearth.api.protocol import StructuredOutputs, _Strict, bad_request

MESSAGES_PATH = "/v1/messages"  # and /v1/messages/count_tokens: Anthropic-shaped errors

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                503: "overloaded_error", 529: "overloaded_error"}


def anthropic_error_body(status: int, openai_body: dict) -> dict:
    """An OpenAI-shaped error body {"error": {"message", ...}} in Anthropic's shape."""
    error = openai_body.get("error") if isinstance(openai_body.get("error"), dict) else {}
    error_type = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": error_type, "message": str(error.get("message") or "")}}


class TextBlock(_Strict):
    type: Literal["text"]
    text: str


class CustomTool(_Strict):
    type: Literal["custom"] | None = None
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class MessageParam(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class Metadata(_Strict):
    user_id: str | None = None


class OutputFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Strict):
    format: OutputFormat | None = None


class _MessagesFields(_Strict):
    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[CustomTool] | None = None
    tool_choice: ToolChoice | None = None


class MessagesRequest(_MessagesFields):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = Field(default=None, max_length=16)
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = None
    top_k: int | None = Field(default=None, ge=0, le=2**31 - 1)
    metadata: Metadata | None = None
    output_config: OutputConfig | None = None  # structured output: format {json_schema}
    # vLLM's extension, as on Chat Completions: the output held to a regex or a grammar
    structured_outputs: StructuredOutputs | None = None
    stream: bool = False


class CountTokensRequest(_MessagesFields):
    pass


def _block_text(block: dict, param: str) -> str:
    if not isinstance(block.get("text"), str):
        raise bad_request(f"{param}.text: expected a string", param=f"{param}.text")
    return block["text"]


def _result_text(block: dict, param: str) -> str:
    content = block.get("content", "")
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        texts = []
        for index, part in enumerate(content):
            part_param = f"{param}.content.{index}"
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else None
                raise bad_request(f"{part_param}.type: tool_result content block {kind!r} is not "
                                  "supported (text only)", param=f"{part_param}.type")
            texts.append(_block_text(part, part_param))
        text = "\n".join(texts)
    else:
        raise bad_request(f"{param}.content: a string or a list of text blocks", param=f"{param}.content")
    return "Error: " + text if block.get("is_error") else text


def _tool_call(block: dict, param: str) -> dict:
    for key in ("id", "name"):
        if not isinstance(block.get(key), str):
            raise bad_request(f"{param}.{key}: expected a string", param=f"{param}.{key}")
    if not isinstance(block.get("input"), dict):
        raise bad_request(f"{param}.input: expected an object", param=f"{param}.input")
    return {"id": block["id"], "type": "function",
            "function": {"name": block["name"], "arguments": json.dumps(block["input"], ensure_ascii=False)}}


def _turn_messages(message: MessageParam, index: int) -> list[dict[str, Any]]:
    """One Anthropic turn -> chat messages: tool results become tool messages (before the user's
    text, as the results answer the previous turn's calls); tool uses become tool calls."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    texts, calls, results, thinking = [], [], [], []
    for block_index, block in enumerate(message.content):
        param = f"messages.{index}.content.{block_index}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(_block_text(block, param))
        elif kind == "thinking" and message.role == "assistant":
            if not isinstance(block.get("thinking"), str):
                raise bad_request(f"{param}.thinking: expected a string", param=f"{param}.thinking")
            thinking.append(block["thinking"])
        elif kind == "redacted_thinking" and message.role == "assistant":
            continue
        elif kind == "tool_use" and message.role == "assistant":
            calls.append(_tool_call(block, param))
        elif kind == "tool_result" and message.role == "user":
            if not isinstance(block.get("tool_use_id"), str):
                raise bad_request(f"{param}.tool_use_id: expected a string", param=f"{param}.tool_use_id")
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                            "content": _result_text(block, param)})
        else:
            raise bad_request(f"{param}.type: content block {kind!r} is not supported in a "
                              f"{message.role} message", param=f"{param}.type")
    text = "\n".join(texts)
    if message.role == "assistant":
        turn: dict[str, Any] = {"role": "assistant", "content": text or None}
        if thinking:
            turn["reasoning_content"] = "\n".join(thinking)
        if calls:
            turn["tool_calls"] = calls
        return [turn]
    return results + ([{"role": "user", "content": text}] if texts or not results else [])


def _system_text(system: str | list[TextBlock] | None) -> str | None:
    if system is None or isinstance(system, str):
        return system or None
    return "\n".join(block.text for block in system) or None


def _tools_fields(request: _MessagesFields) -> dict[str, Any]:
    body: dict[str, Any] = {}
    if request.tools:
        body["tools"] = [{"type": "function", "function": {
            "name": tool.name, "description": tool.description, "parameters": tool.input_schema}}
            for tool in request.tools]
    choice = request.tool_choice
    if choice is None:
        return body
    # Checked here, where /v1/messages and /v1/messages/count_tokens both pass, in the words
    # the Chat path uses (count_tokens had counted a choice that /v1/messages refuses).
    if choice.type == "tool" and not choice.name:
        raise bad_request("tool_choice.name is required for type tool", param="tool_choice.name")
    names = {tool.name for tool in request.tools or ()}
    if choice.type in ("tool", "any") and not names:
        raise bad_request("tool_choice requires tools", param="tool_choice")
    if choice.type == "tool":
        if choice.name not in names:
            raise bad_request(f"tool_choice names function {choice.name!r}, which is not in "
                              "tools", param="tool_choice")
        body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    if choice.disable_parallel_tool_use:
        body["parallel_tool_calls"] = False
    return body


def chat_messages(request: _MessagesFields) -> list[dict[str, Any]]:
    messages = []
    system = _system_text(request.system)
    if system is not None:
        messages.append({"role": "system", "content": system})
    for index, message in enumerate(request.messages):
        messages += _turn_messages(message, index)
    return messages


def to_chat_body(request: MessagesRequest) -> dict[str, Any]:
    """The internal chat request for this Messages request. Pure."""
    body: dict[str, Any] = {"model": request.model, "messages": chat_messages(request),
                            "max_completion_tokens": request.max_tokens, "stream": request.stream,
                            **_tools_fields(request)}
    if request.stop_sequences:
        body["stop"] = list(request.stop_sequences)
    for key, value in (("temperature", request.temperature), ("top_p", request.top_p),
                       ("top_k", request.top_k)):
        if value is not None:
            body[key] = value
    if request.metadata is not None and request.metadata.user_id is not None:
        body["user"] = request.metadata.user_id
    if request.output_config is not None and request.output_config.format is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "output", "schema": request.output_config.format.schema_}}
    if request.structured_outputs is not None:
        body["structured_outputs"] = request.structured_outputs.model_dump(exclude_none=True)
    return body


def to_tokenize_body(request: CountTokensRequest) -> dict[str, Any]:
    """The /tokenize body whose count is what a Messages request with these fields would prefill."""
    tools = _tools_fields(request)
    body: dict[str, Any] = {"messages": chat_messages(request), "add_generation_prompt": True}
    if tools.get("tools") and tools.get("tool_choice") != "none":
        body["tools"] = tools["tools"]
    return body

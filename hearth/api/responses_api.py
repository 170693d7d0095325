"""The OpenAI Responses API's request, translated into the internal chat request.

    POST /v1/responses {input, instructions, tools, tool_choice, text.format, max_output_tokens,
                        temperature, top_p, parallel_tool_calls, previous_response_id, store,
                        structured_outputs (vLLM's extension, as on Chat Completions), ...}
      -> a Chat Completions body (messages, tools, tool_choice, response_format, sampling fields)

Input items (a string is one user message):
    {"role", "content"} / {"type": "message", ...}   content: a string or input_text/output_text parts
    {"type": "function_call", "call_id", "name", "arguments"}   -> an assistant tool call
    {"type": "function_call_output", "call_id", "output"}       -> a tool message
    {"type": "reasoning", "content"|"summary": [{"text"}]}   -> the next assistant turn's
                                                       reasoning_content (its template decides);
                                                       with none: an assistant turn of its own
Consecutive function calls (and the assistant message before them) form one assistant turn, as
the Chat API writes parallel calls. `instructions` is the first system message; it is not carried
over from a previous response (the API's own rule).

`previous_response_id`: the conversation so far (every earlier input item and output item) comes
from a bounded in-memory store (`ResponseStore`), so an agent sends only its new items; the
prompt rendered from history + new items is the same text as a full resend, so the prefix cache
hits. Only function tools; no hosted tools, images, files, background mode or conversations.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field

from hearth.api.protocol import APIError, Int64, StructuredOutputs, _Strict, bad_request

STORE_CAPACITY = 1024  # responses kept for previous_response_id / GET, least recently used first out


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(_Strict):
    type: Literal["function"]
    name: str


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None


class ReasoningConfig(_Strict):
    effort: Literal["low", "medium", "high"] | None = None  # -> the chat request's reasoning_effort
    summary: Literal["auto", "concise", "detailed"] | None = None  # accepted; no summaries are made


class ResponsesRequest(_Strict):
    model: str | None = None
    input: str | list[Any]  # items are checked one by one (items_to_messages)
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    seed: Int64 | None = None  # not in the API; the Chat API's field, accepted the same way
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    reasoning: ReasoningConfig | None = None
    # vLLM's extension, as on Chat Completions: the output held to a regex or a grammar
    structured_outputs: StructuredOutputs | None = None


def _text_of(content: Any, param: str) -> str:
    """A message's or an output's text: a string, or text parts joined by newlines."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{param}: expected a string or a list of content parts", param=param)
    texts = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise bad_request(f"{param}.{index}: content part type {kind!r} is not supported "
                              "(text only)", param=f"{param}.{index}.type")
        texts.append(part["text"])
    return "\n".join(texts)


def _reasoning_text(item: dict, param: str) -> str:
    """A reasoning item's text: its reasoning_text content, else its summary ("" if neither;
    encrypted_content is not ours to read)."""
    for key in ("content", "summary"):
        parts = item.get(key)
        if parts is None:
            continue
        if not isinstance(parts, list) or not all(
                isinstance(p, dict) and isinstance(p.get("text"), str) for p in parts):
            raise bad_request(f"{param}.{key}: a list of {{type, text}} parts",
                              param=f"{param}.{key}")
        if parts:
            return "\n".join(p["text"] for p in parts)
    return ""


def _string(item: dict, key: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad_request(f"{param}.{key}: expected a string", param=f"{param}.{key}")
    return value


def items_to_messages(items: list[dict[str, Any]], first_index: int = 0) -> list[dict[str, Any]]:
    """Responses input items -> Chat Completions messages (first_index: for error params)."""
    messages: list[dict[str, Any]] = []
    reasoning: list[str] = []  # reasoning items waiting for the assistant turn they belong to

    def assistant_turn(message: dict[str, Any]) -> dict[str, Any]:
        if reasoning:
            message["reasoning_content"] = "\n".join(reasoning)
            reasoning.clear()
        return message

    def flush_reasoning() -> None:  # reasoning no assistant item followed: a turn of its own
        if reasoning:
            messages.append(assistant_turn({"role": "assistant", "content": None}))

    for offset, item in enumerate(items):
        param = f"input.{first_index + offset}"
        if not isinstance(item, dict):
            raise bad_request(f"{param}: an input item is an object", param=param)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad_request(f"{param}.role: one of user, assistant, system, developer",
                                  param=f"{param}.role")
            message = {"role": role, "content": _text_of(item.get("content"), f"{param}.content")}
            if role != "assistant":
                flush_reasoning()
            messages.append(assistant_turn(message) if role == "assistant" else message)
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", param), "type": "function",
                    "function": {"name": _string(item, "name", param),
                                 "arguments": _string(item, "arguments", param)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and not reasoning:
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append(assistant_turn({"role": "assistant", "content": None,
                                                "tool_calls": [call]}))
        elif kind == "function_call_output":
            flush_reasoning()
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", param),
                             "content": _text_of(item.get("output"), f"{param}.output")})
        elif kind == "reasoning":
            text = _reasoning_text(item, param)
            if text:
                reasoning.append(text)
        else:
            raise bad_request(f"{param}.type: input item type {kind!r} is not supported (message, "
                              "function_call, function_call_output, reasoning)",
                              param=f"{param}.type")
    flush_reasoning()
    return messages


def input_items(request: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as a list of items (a string input is one user message)."""
    if isinstance(request.input, str):
        return [{"type": "message", "role": "user", "content": request.input}]
    return list(request.input)


def _response_format(text: TextConfig | None) -> dict | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema_ is None:
        raise bad_request("text.format.schema is required for json_schema", param="text.format.schema")
    return {"type": "json_schema", "json_schema": {"name": fmt.name or "response",
                                                   "schema": fmt.schema_, "strict": fmt.strict}}


def to_chat_body(request: ResponsesRequest, history: list[dict[str, Any]]) -> dict[str, Any]:
    """The internal chat request for this Responses request (history: the stored items of the
    previous response). Pure: the same request and history give the same body."""
    messages = items_to_messages(history, first_index=-len(history))
    messages += items_to_messages(input_items(request))
    if request.instructions:
        messages.insert(0, {"role": "system", "content": request.instructions})
    if not messages:
        raise bad_request("input: at least one item is required", param="input")
    body: dict[str, Any] = {"messages": messages, "parallel_tool_calls": request.parallel_tool_calls,
                            "stream": request.stream}
    if request.model is not None:
        body["model"] = request.model
    if request.tools:
        body["tools"] = [{"type": "function", "function": tool.model_dump(
            exclude={"type"}, exclude_none=True)} for tool in request.tools]
    if isinstance(request.tool_choice, FunctionToolChoice):
        body["tool_choice"] = {"type": "function", "function": {"name": request.tool_choice.name}}
    elif request.tool_choice is not None:
        body["tool_choice"] = request.tool_choice
    response_format = _response_format(request.text)
    if response_format is not None:
        body["response_format"] = response_format
    for key, value in (("max_completion_tokens", request.max_output_tokens),
                       ("temperature", request.temperature), ("top_p", request.top_p),
                       ("seed", request.seed), ("user", request.user),
                       ("reasoning_effort", request.reasoning and request.reasoning.effort)):
        if value is not None:
            body[key] = value
    if request.structured_outputs is not None:
        body["structured_outputs"] = request.structured_outputs.model_dump(exclude_none=True)
    return body


@dataclass
class StoredResponse:
    body: dict[str, Any]  # the Response object as it was returned
    items: list[dict[str, Any]]  # the whole conversation: every input item, then the output items


class ResponseStore:
    """A bounded LRU of past responses, for `previous_response_id` and GET /v1/responses/{id}.
    Entries share the item dicts of their ancestors (a follow-up copies a list of references)."""

    def __init__(self, capacity: int = STORE_CAPACITY) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, entry: StoredResponse) -> None:
        self._entries[response_id] = entry
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        """The entry; an OpenAI-shaped 404 when it is unknown (never stored, or evicted)."""
        entry = self._entries.get(response_id)
        if entry is None:
            if param == "previous_response_id":
                raise APIError(404, f"Previous response with id {response_id!r} not found.",
                               "invalid_request_error", param=param, code="previous_response_not_found")
            raise APIError(404, f"No response found with id {response_id!r}.", "invalid_request_error",
                           param=param, code="response_not_found")
        self._entries.move_to_end(response_id)
        return entry


def history_for(store: ResponseStore, request: ResponsesRequest) -> list[dict[str, Any]]:
    if request.previous_response_id is None:
        return []
    return store.get(request.previous_response_id, "previous_response_id").items


def request_echo(request: ResponsesRequest) -> dict[str, Any]:
    """The request's settings as the Response object repeats them."""
    tool_choice = request.tool_choice or "auto"
    fmt = request.text.format if request.text is not None and request.text.format else None
    return {
        "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens,
        "metadata": request.metadata or {},
        "parallel_tool_calls": request.parallel_tool_calls,
        "previous_response_id": request.previous_response_id,
        "temperature": 1.0 if request.temperature is None else request.temperature,
        "top_p": 1.0 if request.top_p is None else request.top_p,
        "tool_choice": tool_choice if isinstance(tool_choice, str) else tool_choice.model_dump(),
        "tools": [tool.model_dump(exclude_none=True) for tool in request.tools or ()],
        "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
        "store": request.store,
        "user": request.user,
        "truncation": "disabled",
        "reasoning": request.reasoning.model_dump() if request.reasoning else None,
        "background": False,
        "service_tier": "default",
    }


def arguments_text(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)

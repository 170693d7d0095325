"""The internal chat output stream -> an Anthropic Message and its stream events.

One writer per message, fed the ChatEvents in order (hearth/api/chat_output.py); the streamed
events and the final Message come from the same bookkeeping. Stream (`event: <type>` + `data:`):

    message_start (content [], usage zeros) -> ping
    per reasoning run: content_block_start {type: thinking, thinking "", signature ""}
                   -> content_block_delta {thinking_delta}... -> content_block_stop
    per text run:  content_block_start {type: text} -> content_block_delta {text_delta}...
                   -> content_block_stop
    per tool call: content_block_start {type: tool_use, id, name, input {}}
                   -> content_block_delta {input_json_delta, partial_json}... -> content_block_stop
    message_delta {stop_reason, stop_sequence} + usage -> message_stop
    (a failure after the start: an `error` event {"type": "error", "error": {...}})

A thinking block's `signature` is "": hearth signs nothing, and a thinking block sent back in
a later request is read whatever its signature (hearth/api/messages_api.py).
stop_reason: end_turn (EOS), stop_sequence (with the string), max_tokens, tool_use.
Usage: `input_tokens` counts the prompt tokens that were computed; the prefix-cache hits are
`cache_read_input_tokens` (Anthropic's total input is their sum); no cache writes are billed.
"""

from __future__ import annotations

import json
from typing import Any

from hearth.api.chat_output import ChatEvent, Failed, Finished
from hearth.api.chat_chunks import Usage
from hearth.api.reasoning import ReasoningDelta
from hearth.api.tool_calls import ToolCallDelta

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def anthropic_usage(usage: Usage | None) -> dict[str, int]:
    usage = usage or Usage()
    return {"input_tokens": usage.prompt_tokens - usage.cached_tokens,
            "output_tokens": usage.completion_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": usage.cached_tokens}


def sse_event(type: str, payload: dict[str, Any]) -> str:
    data = json.dumps({"type": type, **payload}, ensure_ascii=False, separators=(",", ":"))
    return f"event: {type}\ndata: {data}\n\n"


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the object `input` holds (what is not an object becomes {})."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


class MessageWriter:
    def __init__(self, message_id: str, model: str) -> None:
        self.message_id, self.model = message_id, model
        self.content: list[dict[str, Any]] = []  # text blocks; tool_use blocks hold "_json" text
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None
        self.usage: Usage | None = None
        self.failure: str | None = None
        self._open: int | None = None  # block index still receiving deltas
        self._call_blocks: dict[int, int] = {}  # tool call index -> block index

    def start(self) -> list[str]:
        message = {**self._envelope([]), "usage": anthropic_usage(None)}
        return [sse_event("message_start", {"message": message}), sse_event("ping", {})]

    def feed(self, event: ChatEvent) -> list[str]:
        if isinstance(event, str):
            return self._text(event)
        if isinstance(event, ReasoningDelta):
            return self._thinking(event.text)
        if isinstance(event, ToolCallDelta):
            return self._call(event)
        if isinstance(event, Finished):
            return self._finish(event)
        if isinstance(event, Failed):
            self.failure = event.message
            return self._close() + [sse_event("error", {"error": {"type": "api_error",
                                                                  "message": event.message}})]
        raise TypeError(f"not a chat event: {event!r}")

    def _open_block(self, block: dict[str, Any]) -> list[str]:
        self.content.append(block)
        self._open = len(self.content) - 1
        shown = {k: v for k, v in block.items() if k != "_json"}
        return [sse_event("content_block_start", {"index": self._open, "content_block": shown})]

    def _text(self, text: str) -> list[str]:
        out = []
        if self._open is None or self.content[self._open]["type"] != "text":
            out += self._close()
            out += self._open_block({"type": "text", "text": ""})
        self.content[self._open]["text"] += text
        return out + [sse_event("content_block_delta", {
            "index": self._open, "delta": {"type": "text_delta", "text": text}})]

    def _thinking(self, text: str) -> list[str]:
        out = []
        if self._open is None or self.content[self._open]["type"] != "thinking":
            out += self._close()
            out += self._open_block({"type": "thinking", "thinking": "", "signature": ""})
        self.content[self._open]["thinking"] += text
        return out + [sse_event("content_block_delta", {
            "index": self._open, "delta": {"type": "thinking_delta", "thinking": text}})]

    def _call(self, delta: ToolCallDelta) -> list[str]:
        out = []
        if delta.id is not None:
            out += self._close()
            out += self._open_block({"type": "tool_use", "id": delta.id, "name": delta.name or "",
                                     "input": {}, "_json": ""})
            self._call_blocks[delta.index] = self._open
        index = self._call_blocks.get(delta.index)
        if index is None or not delta.arguments:
            return out
        self.content[index]["_json"] += delta.arguments
        return out + [sse_event("content_block_delta", {
            "index": index, "delta": {"type": "input_json_delta", "partial_json": delta.arguments}})]

    def _close(self) -> list[str]:
        if self._open is None:
            return []
        index, self._open = self._open, None
        block = self.content[index]
        if block["type"] == "tool_use":
            block["input"] = tool_input(block["_json"])
        return [sse_event("content_block_stop", {"index": index})]

    def _finish(self, finished: Finished) -> list[str]:
        out = self._close()
        self.usage = finished.usage
        self.stop_reason = STOP_REASONS.get(finished.reason, "end_turn")
        if finished.stop_sequence is not None and finished.reason == "stop":
            self.stop_reason, self.stop_sequence = "stop_sequence", finished.stop_sequence
        delta = {"stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence}
        return out + [sse_event("message_delta", {"delta": delta, "usage": anthropic_usage(self.usage)}),
                      sse_event("message_stop", {})]

    def _envelope(self, content: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.message_id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": self.stop_reason,
                "stop_sequence": self.stop_sequence}

    def body(self) -> dict[str, Any]:
        content = [{k: v for k, v in block.items() if k != "_json"} for block in self.content]
        return {**self._envelope(content), "usage": anthropic_usage(self.usage)}

"""The internal chat output stream -> an OpenAI Responses API Response and its stream events.

One writer per response, fed the ChatEvents in order (hearth/api/chat_output.py); the streamed
events and the final Response object come from the same bookkeeping, so both modes report the
same output. Stream (each event `event: <type>` + `data: {..., "sequence_number": n}`):

    response.created, response.in_progress                       (status in_progress, output [])
    per reasoning run: response.output_item.added (reasoning) -> response.content_part.added
                    -> response.reasoning_text.delta... -> response.reasoning_text.done
                    -> response.content_part.done -> response.output_item.done
    per text run:   response.output_item.added (message) -> response.content_part.added
                    -> response.output_text.delta... -> response.output_text.done
                    -> response.content_part.done -> response.output_item.done
    per tool call:  response.output_item.added (function_call) ->
                    response.function_call_arguments.delta... -> ...arguments.done
                    -> response.output_item.done
    response.completed | response.incomplete (max_output_tokens) | response.failed

Output items: {"type": "message", "id": "msg_...", "role": "assistant", "status",
"content": [{"type": "output_text", "text", "annotations": [], "logprobs": []}]} and
{"type": "function_call", "id": "fc_...", "call_id", "name", "arguments", "status"} and
{"type": "reasoning", "id": "rs_...", "summary": [], "status",
"content": [{"type": "reasoning_text", "text"}]} (the model's own reasoning text, unsummarised).
"""

from __future__ import annotations

import copy
import json
import secrets
from typing import Any

from hearth.api.chat_output import ChatEvent, Failed, Finished
from hearth.api.chat_chunks import Usage
from hearth.api.reasoning import ReasoningDelta
from hearth.api.tool_calls import ToolCallDelta


def response_usage(usage: Usage) -> dict[str, Any]:
    return {"input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens or 0},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}


def _item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


class ResponseWriter:
    def __init__(self, response_id: str, model: str, created_at: int, echo: dict[str, Any]) -> None:
        self.response_id, self.model, self.created_at, self.echo = response_id, model, created_at, echo
        self.output: list[dict[str, Any]] = []
        self.status = "in_progress"
        self.usage: Usage | None = None
        self.error: dict | None = None
        self.incomplete_details: dict | None = None
        self._sequence = 0
        self._open: int | None = None  # output index of the item still receiving deltas
        self._call_items: dict[int, int] = {}  # tool call index -> output index

    # ---- events out ---------------------------------------------------------------------------
    def _event(self, type: str, **fields: Any) -> str:
        payload = {"type": type, **fields, "sequence_number": self._sequence}
        self._sequence += 1
        data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
        return f"event: {type}\ndata: {data}\n\n"

    def start(self) -> list[str]:
        snapshot = self.body()
        return [self._event("response.created", response=snapshot),
                self._event("response.in_progress", response=snapshot)]

    def feed(self, event: ChatEvent) -> list[str]:
        if isinstance(event, str):
            return self._text(event)
        if isinstance(event, ReasoningDelta):
            return self._text(event.text, reasoning=True)
        if isinstance(event, ToolCallDelta):
            return self._call(event)
        if isinstance(event, Finished):
            return self._finish(event)
        if isinstance(event, Failed):
            return self._fail(event.message)
        raise TypeError(f"not a chat event: {event!r}")

    # ---- items --------------------------------------------------------------------------------
    def _open_message(self, reasoning: bool = False) -> list[str]:
        if reasoning:
            item = {"type": "reasoning", "id": _item_id("rs"), "summary": [],
                    "status": "in_progress", "content": []}
            part = {"type": "reasoning_text", "text": ""}
        else:
            item = {"type": "message", "id": _item_id("msg"), "role": "assistant",
                    "status": "in_progress", "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self.output.append(item)
        self._open = len(self.output) - 1
        out = [self._event("response.output_item.added", output_index=self._open,
                           item=copy.deepcopy(item))]
        item["content"].append(part)
        out.append(self._event("response.content_part.added", item_id=item["id"],
                               output_index=self._open, content_index=0, part=dict(part)))
        return out

    def _text(self, text: str, reasoning: bool = False) -> list[str]:
        out = []
        kind = "reasoning" if reasoning else "message"
        if self._open is None or self.output[self._open]["type"] != kind:
            out += self._close("completed")
            out += self._open_message(reasoning)
        item = self.output[self._open]
        item["content"][0]["text"] += text
        if reasoning:
            out.append(self._event("response.reasoning_text.delta", item_id=item["id"],
                                   output_index=self._open, content_index=0, delta=text))
        else:
            out.append(self._event("response.output_text.delta", item_id=item["id"],
                                   output_index=self._open, content_index=0, delta=text,
                                   logprobs=[]))
        return out

    def _call(self, delta: ToolCallDelta) -> list[str]:
        out = []
        if delta.id is not None:
            out += self._close("completed")
            item = {"type": "function_call", "id": _item_id("fc"), "call_id": delta.id,
                    "name": delta.name or "", "arguments": "", "status": "in_progress"}
            self.output.append(item)
            self._open = self._call_items[delta.index] = len(self.output) - 1
            out.append(self._event("response.output_item.added", output_index=self._open,
                                   item=dict(item)))
        index = self._call_items.get(delta.index)
        if index is None or not delta.arguments:
            return out
        item = self.output[index]
        item["arguments"] += delta.arguments
        out.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                               output_index=index, delta=delta.arguments))
        return out

    def _close(self, status: str) -> list[str]:
        """Finish the item still receiving deltas (its *.done events)."""
        if self._open is None:
            return []
        index, self._open = self._open, None
        item = self.output[index]
        item["status"] = status
        out = []
        if item["type"] == "reasoning":
            part = item["content"][0]
            out.append(self._event("response.reasoning_text.done", item_id=item["id"],
                                   output_index=index, content_index=0, text=part["text"]))
            out.append(self._event("response.content_part.done", item_id=item["id"],
                                   output_index=index, content_index=0, part=dict(part)))
        elif item["type"] == "message":
            part = item["content"][0]
            out.append(self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                   content_index=0, text=part["text"], logprobs=[]))
            out.append(self._event("response.content_part.done", item_id=item["id"],
                                   output_index=index, content_index=0, part=dict(part)))
        else:
            out.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                   output_index=index, name=item["name"], arguments=item["arguments"]))
        out.append(self._event("response.output_item.done", output_index=index,
                               item=copy.deepcopy(item)))
        return out

    # ---- the end ------------------------------------------------------------------------------
    def _finish(self, finished: Finished) -> list[str]:
        truncated = finished.reason == "length"
        out = []
        if not self.output:  # an empty answer is still an (empty) assistant message
            out += self._open_message()
        out += self._close("incomplete" if truncated else "completed")
        self.usage = finished.usage
        if truncated:
            self.status, self.incomplete_details = "incomplete", {"reason": "max_output_tokens"}
            return out + [self._event("response.incomplete", response=self.body())]
        self.status = "completed"
        return out + [self._event("response.completed", response=self.body())]

    def _fail(self, message: str) -> list[str]:
        out = self._close("incomplete")
        self.status = "failed"
        self.error = {"code": "server_error", "message": message}
        return out + [self._event("response.failed", response=self.body())]

    def body(self) -> dict[str, Any]:
        """The Response object as it stands (the final one once Finished or Failed was fed)."""
        return {
            "id": self.response_id, "object": "response", "created_at": self.created_at,
            "status": self.status, "error": self.error, "incomplete_details": self.incomplete_details,
            "model": self.model, "output": copy.deepcopy(self.output),
            "usage": response_usage(self.usage) if self.usage is not None else None,
            **self.echo,
        }

"""The internal output stream of one chat request: what every front door translates back.

All three APIs (Chat Completions, Responses, Anthropic Messages) map onto one internal request,
a `ChatCompletionRequest` (messages + tools + tool_choice + response_format + sampling fields),
and read one internal output stream back:

    ChatEvent = str (content text) | ReasoningDelta | ToolCallDelta | Finished | Failed

in output order, exactly one `Finished` or `Failed` last. A worker produces it straight from the
engine and the request's tool parser (`serving_chat.chat_events`); the router reads it off the
stitched Chat Completions stream it already builds (`ChatChunkReader`). So tool parsing, grammar
building and PD stitching exist once, and a front door is only two pure translations: its request
into a chat request, and these events into its own wire shape.

ReasoningDelta (with `--reasoning-parser`) is the model's reasoning, which comes before the
content and calls of the same output. ToolCallDelta keeps the tool parser's contract: a call's first delta has id and name (arguments
""), its later deltas carry argument fragments only.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, Union

from hearth.api.chat_chunks import Usage
from hearth.api.reasoning import ReasoningDelta
from hearth.api.tool_calls import ToolCallDelta


@dataclass
class Finished:
    reason: str  # the Chat API's finish_reason: "stop" | "length" | "tool_calls" | "abort"
    usage: Usage
    stop_sequence: str | None = None  # the stop string that ended the output, if one did


@dataclass
class Failed:
    message: str  # the engine (or every endpoint the router tried) failed after output began


ChatEvent = Union[str, ReasoningDelta, ToolCallDelta, Finished, Failed]


class ChatEvents:
    """A chat request's ChatEvents, closable before its first event was pulled: `aclose()`
    always runs `release` (the worker aborts its engine requests, the router closes its stitched
    stream and ticket), even if the generator never started (a client gone before the first
    byte), where a generator's own `finally` would never run."""

    def __init__(self, events: AsyncIterator[ChatEvent],
                 release: Callable[[], Awaitable[None] | None]) -> None:
        self._events, self._release = events, release

    def __aiter__(self) -> AsyncIterator[ChatEvent]:
        return self._events

    async def aclose(self) -> None:
        try:
            await self._events.aclose()
        finally:
            result = self._release()
            if inspect.isawaitable(result):
                await result


def usage_from_dict(usage: dict | None) -> Usage:
    usage = usage or {}
    details = usage.get("prompt_tokens_details") or {}
    reasoning = (usage.get("completion_tokens_details") or {}).get("reasoning_tokens")
    return Usage(prompt_tokens=int(usage.get("prompt_tokens") or 0),
                 completion_tokens=int(usage.get("completion_tokens") or 0),
                 cached_tokens=int(details.get("cached_tokens") or 0),
                 reasoning_tokens=None if reasoning is None else int(reasoning))


class ChatChunkReader:
    """Chat Completions stream payloads (one choice, `include_usage` on) -> ChatEvents.

    The finish chunk comes before the usage chunk, so `Finished` is produced by `done()`, which
    the caller invokes on `data: [DONE]`. An error payload ends the stream as `Failed`."""

    def __init__(self) -> None:
        self._finish_reason: str | None = None
        self._stop_sequence: str | None = None
        self._usage: dict | None = None
        self.ended = False

    def feed(self, payload: dict[str, Any]) -> list[ChatEvent]:
        if self.ended:
            return []
        if isinstance(payload.get("error"), dict):
            self.ended = True
            return [Failed(str(payload["error"].get("message") or "the request failed"))]
        if payload.get("usage"):
            self._usage = payload["usage"]
        events: list[ChatEvent] = []
        for choice in payload.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                events.append(ReasoningDelta(delta["reasoning_content"]))
            if delta.get("content"):
                events.append(delta["content"])
            for call in delta.get("tool_calls") or ():
                function = call.get("function") or {}
                index = int(call.get("index", 0))
                if call.get("id"):
                    events.append(ToolCallDelta(index, id=call["id"], name=function.get("name") or "",
                                                arguments=function.get("arguments") or ""))
                elif function.get("arguments"):
                    events.append(ToolCallDelta(index, arguments=function["arguments"]))
            if choice.get("finish_reason"):
                self._finish_reason = choice["finish_reason"]
                stop = choice.get("stop_reason")
                self._stop_sequence = stop if isinstance(stop, str) else None
        return events

    def done(self) -> list[ChatEvent]:
        if self.ended:
            return []
        self.ended = True
        if self._finish_reason is None:
            return [Failed("the stream ended without a finish reason")]
        return [Finished(self._finish_reason, usage_from_dict(self._usage), self._stop_sequence)]

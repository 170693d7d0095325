"""One choice's output text -> its events: the reasoning parser first, then the tool parser.

    text -> [reasoning parser] -> ReasoningDelta ........................-> events
                               -> content str -> [tool parser] -> str | ToolCallDelta -> events

Either parser may be absent. The reasoning parser decides what is reasoning; only the content it
passes on reaches the tool parser, so markup inside a `<think>` block is never a call. Both keep
their split-independence, so the composition does too: the events depend only on the whole text.
"""

from __future__ import annotations

from typing import Union

from hearth.api.reasoning import ReasoningDelta
from hearth.server.reasoning_parsers import ReasoningParser
from hearth.server.tool_parsers import Event, ToolParser
from hearth.server.tool_parsers.parser_base import append_content

OutputEvent = Union[Event, ReasoningDelta]


class OutputParser:
    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None) -> None:
        self.reasoning = reasoning
        self.tools = tools

    def feed(self, text: str) -> list[OutputEvent]:
        if self.reasoning is None:
            return self._content(text)
        events: list[OutputEvent] = []
        for event in self.reasoning.feed(text):
            events += [event] if isinstance(event, ReasoningDelta) else self._content(event)
        return events

    def finish(self) -> list[OutputEvent]:
        events: list[OutputEvent] = []
        if self.reasoning is not None:
            for event in self.reasoning.finish():
                events += [event] if isinstance(event, ReasoningDelta) else self._content(event)
        if self.tools is not None:
            events += self.tools.finish()
        return events

    def _content(self, text: str) -> list[OutputEvent]:
        if self.tools is not None:
            return list(self.tools.feed(text))
        return [text] if text else []


def assemble_reasoning(events: list[OutputEvent]) -> str | None:
    """The reasoning of a non-streamed answer (None when there was none)."""
    return "".join(e.text for e in events if isinstance(e, ReasoningDelta)) or None


def merged(events: list[OutputEvent]) -> list[OutputEvent]:
    """Adjacent content strings and adjacent reasoning pieces joined (for tests and folding)."""
    out: list[OutputEvent] = []
    for event in events:
        if isinstance(event, str):
            append_content(out, event)  # type: ignore[arg-type]
        elif isinstance(event, ReasoningDelta) and out and isinstance(out[-1], ReasoningDelta):
            out[-1] = ReasoningDelta(out[-1].text + event.text)
        else:
            out.append(event)
    return out

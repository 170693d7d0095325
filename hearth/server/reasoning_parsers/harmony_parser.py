"""openai_gptoss (alias harmony): gpt-oss's reasoning, the bodies of its `analysis` messages.

    output:  <|channel|>analysis<|message|>REASONING<|end|>
             <|start|>assistant<|channel|>final<|message|>ANSWER<|return|>

(Shown on two lines: nothing stands between the messages.) Each analysis message (one with no
recipient: an analysis message addressed to a tool is a call) is taken out of the output whole
and its body becomes reasoning. Every other message passes on verbatim, its markup included, to
the `openai` tool parser (hearth/server/tool_parsers/openai_parser.py), which reads final and
commentary messages into content and tool calls; the server always pairs the two
(`content_parser`). Both read the text through hearth/api/harmony.py's `HarmonyReader`, so the
events depend only on the concatenated text. An analysis message cut off at the end of the
output keeps what it produced as reasoning.
"""

from __future__ import annotations

from hearth.api.harmony import Body, End, Header, HarmonyReader, Plain
from hearth.api.reasoning import ReasoningDelta
from hearth.server.reasoning_parsers.think_parser import ReasoningEvent, append_event


class HarmonyReasoningParser:
    content_parser = "openai"  # the tool parser that reads the content this one passes on

    def __init__(self) -> None:
        self._reader = HarmonyReader()
        self._in_analysis = False
        self._spans: list[tuple[int, int]] = []  # [start, end) of each analysis message, markup in
        self._open_start: int | None = None  # start of the analysis message being read

    def feed(self, text: str) -> list[ReasoningEvent]:
        return self._events(self._reader.feed(text))

    def finish(self) -> list[ReasoningEvent]:
        return self._events(self._reader.finish())

    def is_reasoning_at(self, offset: int) -> bool:
        """Whether the output's character at `offset` lies in an analysis message (its markup
        included); text not yet read into a message counts as not."""
        if self._open_start is not None and offset >= self._open_start:
            return True
        return any(start <= offset < end for start, end in self._spans)

    def _events(self, harmony_events: list) -> list[ReasoningEvent]:
        events: list[ReasoningEvent] = []
        for event in harmony_events:
            if isinstance(event, Header):
                self._in_analysis = event.is_reasoning
                if self._in_analysis:
                    self._open_start = event.offset
                else:
                    append_event(events, event.raw)
            elif isinstance(event, Body):
                append_event(events, ReasoningDelta(event.text) if self._in_analysis else event.text)
            elif isinstance(event, End):
                if self._in_analysis:
                    assert self._open_start is not None
                    self._spans.append((self._open_start, event.offset))
                    self._open_start, self._in_analysis = None, False
                else:
                    append_event(events, event.raw)
            elif isinstance(event, Plain):
                append_event(events, event.text)
        return events

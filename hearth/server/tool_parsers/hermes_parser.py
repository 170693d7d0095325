"""hermes: calls in tags, one JSON object each (Hermes, Qwen 2/2.5/3, and hearth's own prompt
section for templates without tools; the fallback of `--tool-call-parser auto`).

    text <tool_call>{"name": "f", "arguments": {...}}</tool_call> ...

A start tag cut off at the end of the output is markup, not content (parser_base.py's rules).
"""

from __future__ import annotations

from typing import Callable

from hearth.api.tool_calls import random_call_id
from hearth.server.tool_parsers.parser_base import CallEmitter, Event, ToolParser, partial_suffix


class HermesToolParser(ToolParser):
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, make_call_id: Callable[[], str] = random_call_id) -> None:
        super().__init__(make_call_id)
        self._call: CallEmitter | None = None

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = []
        self._pending += text
        while self._pending:
            if self._call is None and not self._scan_text(events):
                break
            if self._call is not None and not self._scan_call(events):
                break
        return events

    def _scan_text(self, events: list[Event]) -> bool:
        """Content up to a start tag; False when the rest must wait for more text."""
        at = self._pending.find(self.START)
        if at < 0:
            keep = partial_suffix(self._pending, self.START)
            self._emit_content(self._pending[: len(self._pending) - keep], events)
            self._pending = self._pending[len(self._pending) - keep :]
            return False
        self._emit_content(self._pending[:at], events)
        self._pending = self._pending[at + len(self.START) :]
        self._call = self._start_call()
        return True

    def _scan_call(self, events: list[Event]) -> bool:
        """Body up to the end tag; False when the rest must wait for more text."""
        assert self._call is not None
        at = self._pending.find(self.END)
        body_len = at if at >= 0 else len(self._pending) - partial_suffix(self._pending, self.END)
        body = self._pending[:body_len]
        if not self._call.scanner.done:
            self._call.scanner.feed(body)
        self._call.progress(events)
        if at < 0:
            self._pending = self._pending[body_len:]
            return False
        self._pending = self._pending[at + len(self.END) :]
        self._close_call(events)
        return True

    def _close_call(self, events: list[Event]) -> None:
        assert self._call is not None
        if self._call.close(events):
            self._end_call()
        else:
            self._drop_markup()
        self._call = None

    def finish(self) -> list[Event]:
        events: list[Event] = []
        if self._call is not None:
            if not self._call.scanner.done:
                self._call.scanner.feed(self._pending)
            self._close_call(events)
        elif len(self._pending) >= 2:  # a start tag cut off ("<t" ... "<tool_call"): markup
            self._drop_markup()
        else:
            self._emit_content(self._pending, events)
        self._pending = ""
        self._flush_held_space(events)
        return events

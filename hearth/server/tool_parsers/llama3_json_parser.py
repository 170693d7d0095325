"""llama3_json: calls as bare JSON objects (Llama 3.x), `;`-separated, optionally after
`<|python_tag|>`; an output that does not start with "{" is plain content.

    {"name": "f", "parameters": {...}}; {"name": "g", "parameters": {...}}
"""

from __future__ import annotations

from typing import Callable

from hearth.api.tool_calls import random_call_id
from hearth.server.tool_parsers.parser_base import CallEmitter, Event, ToolParser


class Llama3JsonToolParser(ToolParser):
    PYTHON_TAG = "<|python_tag|>"
    requires_arguments = True

    @classmethod
    def writes_template(cls, chat_template: str) -> bool:
        return "<|start_header_id|>" in chat_template  # Llama 3's turn headers

    def __init__(self, make_call_id: Callable[[], str] = random_call_id) -> None:
        super().__init__(make_call_id)
        self._mode = "start"  # start | call | between | content
        self._call: CallEmitter | None = None

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = []
        self._pending += text
        while self._pending and self._advance(events):
            pass
        return events

    def _advance(self, events: list[Event]) -> bool:
        """One decision on the pending text; False when it must wait for more text."""
        if self._mode == "content":
            self._emit_content(self._pending, events)
            self._pending = ""
            return False
        if self._mode == "call":
            return self._scan_call(events)
        stripped = self._pending.lstrip()
        if self._mode == "between":
            stripped = stripped.lstrip(";").lstrip()
        if self._mode == "start" and self.PYTHON_TAG.startswith(stripped):
            return False  # maybe the tag, maybe not: wait
        if stripped.startswith(self.PYTHON_TAG):
            stripped = stripped[len(self.PYTHON_TAG) :].lstrip()
        if not stripped:
            return False
        if stripped[0] == "{":
            self._pending = stripped
            self._mode, self._call = "call", self._start_call()
            return True
        if self._mode == "start":
            self._emit_content(self._pending, events)
        else:
            self._emit_content(stripped, events)
        self._mode, self._pending = "content", ""
        return False

    def _scan_call(self, events: list[Event]) -> bool:
        assert self._call is not None
        consumed = self._call.scanner.feed(self._pending)
        self._pending = self._pending[consumed:]
        self._call.progress(events)
        if not self._call.scanner.done:
            return False
        self._close_call(events)
        return True

    def _close_call(self, events: list[Event]) -> None:
        assert self._call is not None
        scanner = self._call.scanner
        if self._call.close(events):
            self._end_call()
            self._mode = "between"
        elif not scanner.done and _may_be_call(scanner.text):  # a call cut off before its name
            self._drop_markup()
            self._mode = "content"
        else:  # a JSON object that is not a call: the whole output is content
            self._emit_content(scanner.text, events)
            self._mode = "content"
        self._call = None

    def finish(self) -> list[Event]:
        events: list[Event] = []
        if self._call is not None:
            self._close_call(events)
        if self._mode == "start" or self._mode == "content":
            self._emit_content(self._pending, events)
        self._pending = ""
        self._flush_held_space(events)
        return events


def _may_be_call(text: str) -> bool:
    """Whether a cut-off JSON object still reads as the start of {"name": ...}."""
    compact = "".join(text.split())
    return bool(compact) and (compact.startswith('{"name"') or '{"name"'.startswith(compact))

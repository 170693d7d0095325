"""The parser of tool-call formats whose calls sit in a section of marker tokens. A format
(kimi_k2_parser.py, deepseek_parser.py) is one `SectionMarkup` and a `SectionToolParser` subclass
naming it; the markup is both what the parser reads and what the grammar (tool_grammar.py)
writes.

    text SECTION_BEGIN CALL_BEGIN header HEADER_END arguments CALL_END ... SECTION_END

The parser keeps `ToolParser`'s invariant (the result depends only on the text, never on how it
was split): it moves through text -> section -> header -> arguments -> section ... and decides
only on text already seen, holding back a suffix that could still become a marker. Markers never
reach content: a stray one (an end marker outside a section) is dropped. A call marker without a
section begin still opens a call; text in a section that is no call ends the section. A call
that ends (or is cut off) before its arguments begin is dropped and counted in `num_dropped`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from hearth.api.tool_calls import random_call_id
from hearth.server.tool_parsers.call_scanner import CallScanner
from hearth.server.tool_parsers.parser_base import CallEmitter, Event, ToolParser, partial_suffix


@dataclass(frozen=True)
class SectionMarkup:
    """One format's markup. A call is written as

        call_begin + name_prefix + NAME + name_suffix [+ index] + header_end + args_prefix
        + ARGUMENTS + args_suffix + call_end

    and the text between call_begin and header_end is the call's header."""

    section_begin: str
    section_end: str
    call_begin: str
    header_end: str  # ends the header: where the arguments begin
    call_end: str
    separator: str  # the special token inside or after the header (the name follows it)
    name_prefix: str = ""
    name_suffix: str = ""
    args_prefix: str = ""
    args_suffix: str = ""
    numbered: bool = False  # the header ends with ":N" and is the call's id (Kimi K2)
    other_section_begin: str | None = None  # also read as a section begin (Kimi's singular)
    other_section_end: str | None = None

    @property
    def section_begins(self) -> tuple[str, ...]:
        return (self.section_begin,) + ((self.other_section_begin,) if self.other_section_begin else ())

    @property
    def section_ends(self) -> tuple[str, ...]:
        return (self.section_end,) + ((self.other_section_end,) if self.other_section_end else ())

    @property
    def markers(self) -> tuple[str, ...]:
        """The special tokens of the format: never content."""
        return (*self.section_begins, *self.section_ends, self.call_begin, self.call_end,
                self.separator)

    def read_header(self, header: str, index: int) -> tuple[str | None, str | None]:
        """(name, call id or None for a random one) of a call's header; name None: unusable."""
        header = header.strip()
        if self.separator in header:  # DeepSeek V3: "function<｜tool▁sep｜>NAME"
            header = header.rsplit(self.separator, 1)[1].strip()
        call_id = None
        if self.numbered:
            numbered = re.fullmatch(r"(.*?)\s*:\s*(\d+)", header, re.DOTALL)
            name = (numbered.group(1) if numbered else header).removeprefix(self.name_prefix)
            call_id = header if numbered else f"{self.name_prefix}{name}:{index}"
        else:
            name = header.removeprefix(self.name_prefix)
        name = name.strip()
        return (name or None), (call_id if name else None)


class SectionToolParser(ToolParser):
    """A section format's parser: a subclass sets `markup`."""

    markup: SectionMarkup
    special_tokens = True  # the markers are special tokens of the models' vocabularies

    def __init__(self, make_call_id: Callable[[], str] = random_call_id) -> None:
        super().__init__(make_call_id)
        self._mode = "text"  # text | section | header | arguments
        self._header = ""
        self._call: CallEmitter | None = None

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = []
        self._pending += text
        while self._pending and self._advance(events):
            pass
        return events

    def _advance(self, events: list[Event]) -> bool:
        """One decision on the pending text; False when it must wait for more text."""
        if self._mode == "text":
            return self._scan_text(events)
        if self._mode == "section":
            return self._scan_section()
        if self._mode == "header":
            return self._scan_header()
        return self._scan_arguments(events)

    def _scan_text(self, events: list[Event]) -> bool:
        markup = self.markup
        at, marker = _first_marker(self._pending, markup.markers)
        if marker is None:
            keep = _held_suffix(self._pending, markup.markers)
            self._emit_content(self._pending[: len(self._pending) - keep], events)
            self._pending = self._pending[len(self._pending) - keep :]
            return False
        self._emit_content(self._pending[:at], events)
        self._pending = self._pending[at + len(marker) :]
        if marker in markup.section_begins:
            self._held_space = ""  # whitespace right before the calls is dropped
            self._mode = "section"
        elif marker == markup.call_begin:  # a call without its section: still a call
            self._open_call()
        return True  # any other marker is stray markup: dropped

    def _scan_section(self) -> bool:
        markup = self.markup
        stripped = self._pending.lstrip()
        self._pending = stripped
        if not stripped:
            return False
        for marker in (markup.call_begin, *markup.section_ends):
            if stripped.startswith(marker):
                self._pending = stripped[len(marker) :]
                if marker == markup.call_begin:
                    self._open_call()
                else:
                    self._mode, self._after_call = "text", True
                return True
        if any(m.startswith(stripped) for m in (markup.call_begin, *markup.section_ends)):
            return False
        self._mode = "text"  # text that is no call ends the section
        return True

    def _open_call(self) -> None:
        self._mode, self._header = "header", ""

    def _scan_header(self) -> bool:
        markup = self.markup
        ends = (markup.header_end, markup.call_end, markup.call_begin, *markup.section_ends)
        at, marker = _first_marker(self._pending, ends)
        if marker is None:
            keep = _held_suffix(self._pending, ends)
            self._header += self._pending[: len(self._pending) - keep]
            self._pending = self._pending[len(self._pending) - keep :]
            return False
        self._header += self._pending[:at]
        if marker == markup.header_end:
            self._pending = self._pending[at + len(marker) :]
            name, call_id = markup.read_header(self._header, self._num_calls)
            self._call = self._start_call(CallScanner.for_arguments(name), call_id)
            self._mode = "arguments"
            return True
        # The call ended, or another began, before its arguments: no call.
        self._pending = self._pending[at + (len(marker) if marker == markup.call_end else 0) :]
        self._drop_markup()
        self._mode = "section"
        return True

    def _scan_arguments(self, events: list[Event]) -> bool:
        assert self._call is not None
        markup = self.markup
        ends = (markup.call_end, markup.call_begin, *markup.section_ends)
        at, marker = _first_marker(self._pending, ends)
        body_len = at if marker is not None else len(self._pending) - _held_suffix(self._pending, ends)
        self._feed_arguments(self._pending[:body_len])
        self._call.progress(events)
        if marker is None:
            self._pending = self._pending[body_len:]
            return False
        # A missing call end before the next call or the section's end is forgiven.
        self._pending = self._pending[at + (len(marker) if marker == markup.call_end else 0) :]
        self._close_call(events)
        self._mode = "section"
        return True

    def _feed_arguments(self, text: str) -> None:
        """Feed the arguments value; what follows it (DeepSeek V3's closing fence) is not."""
        assert self._call is not None
        scanner = self._call.scanner
        if not scanner.done and scanner.args_end < 0:
            scanner.feed(text)

    def _close_call(self, events: list[Event]) -> None:
        assert self._call is not None
        if self._call.close(events):
            self._end_call()
        else:
            self._drop_markup()
        self._call = None

    def finish(self) -> list[Event]:
        events: list[Event] = []
        if self._mode == "arguments":
            self._feed_arguments(self._pending)
            self._close_call(events)
        elif self._mode == "header":  # cut off before its arguments began
            self._drop_markup()
        elif self._mode == "text":
            if len(self._pending) >= 2:  # a marker cut off at the end ("<|tool"): markup
                self._drop_markup()
            else:
                self._emit_content(self._pending, events)
        self._pending, self._mode = "", "text"
        self._flush_held_space(events)
        return events


def _first_marker(text: str, markers: tuple[str, ...]) -> tuple[int, str | None]:
    """Where the first of `markers` starts in `text` (the longer on a tie), or (-1, None)."""
    best_at, best = -1, None
    for marker in markers:
        at = text.find(marker)
        if at >= 0 and (best is None or at < best_at or (at == best_at and len(marker) > len(best))):
            best_at, best = at, marker
    return best_at, best


def _held_suffix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that could still become one of `markers`."""
    return max(partial_suffix(text, marker) for marker in markers)

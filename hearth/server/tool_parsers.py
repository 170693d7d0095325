"""Incremental tool-call parsers: model output text -> content and OpenAI tool-call deltas.

One parser object per request (per choice). `feed(text)` takes the next piece of output text and
returns events in output order: `str` for content, `ToolCallDelta` for tool calls. `finish()`
flushes what is held back at the end of the output.

The invariant every test checks: the events' content and the assembled calls depend only on the
concatenated text, never on how it was split into deltas. Every decision is made on text already
seen: a suffix that could still become a tag is held back until it is decided, and a call's
header (id + name) goes out once its name is complete and its arguments have begun.

Formats:

    hermes       text <tool_call>{"name": "f", "arguments": {...}}</tool_call> ...
                 (Hermes, Qwen 2/2.5/3, and hearth's own prompt section for templates without tools)
    llama3_json  {"name": "f", "parameters": {...}}; {"name": "g", "parameters": {...}}
                 (Llama 3.x; an output that does not start with "{" is plain content)
    kimi_k2, deepseek_v3, deepseek_v31
                 calls in a section of marker tokens (tool_sections.py)

Streaming shape (as OpenAI sends it): per call, first ToolCallDelta(index, id, name, arguments="")
then ToolCallDelta(index, arguments=fragment)... Whitespace right before or after a call is
dropped; content that is only whitespace is dropped when the output has tool calls.

Tool markup never reaches content. A call cut off (max_tokens) once its name is complete is
reported with the arguments produced so far, as OpenAI reports a length stop; a call that never
got a name (cut off early, or malformed) is dropped and counted in `num_dropped`, and so is a
start tag cut off at the end of the output.
"""

from __future__ import annotations

from typing import Callable, Union

from hearth.api.tool_calls import ToolCall, ToolCallDelta, random_call_id
from hearth.server.tool_call_scanner import CallScanner

TOOL_PARSERS = ("hermes", "llama3_json", "kimi_k2", "deepseek_v3", "deepseek_v31")
# Formats whose markup is special tokens in their models' vocabularies: the output text must keep
# special tokens (the parser reads the markup and keeps it out of content).
SPECIAL_TOKEN_PARSERS = ("kimi_k2", "deepseek_v3", "deepseek_v31")


Event = Union[str, ToolCallDelta]


class _CallEmitter:
    """Turns one scanner's progress into ToolCallDeltas for call number `index`."""

    def __init__(
        self, index: int, make_call_id: Callable[[], str], require_arguments: bool,
        scanner: CallScanner | None = None,
    ) -> None:
        self.index = index
        # Llama 3 calls are bare JSON: an object without an arguments key is content, not a call.
        self.require_arguments = require_arguments
        self.scanner = scanner or CallScanner()
        self.call_id = make_call_id()
        self.header_sent = False
        self.num_args_sent = 0
        self.args_sent_final = False

    def progress(self, events: list[Event]) -> None:
        scanner = self.scanner
        if not self.header_sent:
            may_be_bare = scanner.done and not self.require_arguments
            if scanner.name is None or not (scanner.args_started or may_be_bare):
                return
            events.append(ToolCallDelta(self.index, id=self.call_id, name=scanner.name))
            self.header_sent = True
        if scanner.args_is_container:
            ready = scanner.args_text_ready()
            if len(ready) > self.num_args_sent:
                events.append(ToolCallDelta(self.index, arguments=ready[self.num_args_sent :]))
                self.num_args_sent = len(ready)

    def close(self, events: list[Event]) -> bool:
        """Emit what is left; False if this never became a call (no name)."""
        self.progress(events)
        if not self.header_sent:
            if self.scanner.name is None or (
                self.require_arguments and not self.scanner.args_started
            ):
                return False
            events.append(ToolCallDelta(self.index, id=self.call_id, name=self.scanner.name))
            self.header_sent = True
        if self.scanner.args_is_container and self.num_args_sent:
            return True
        final = self.scanner.final_arguments()
        events.append(ToolCallDelta(self.index, arguments=final[self.num_args_sent :]))
        return True


class ToolParser:
    """Base: content/whitespace bookkeeping shared by the formats."""

    def __init__(self, make_call_id: Callable[[], str] = random_call_id) -> None:
        self._make_call_id = make_call_id
        self._pending = ""  # text not yet decided
        self._held_space = ""  # whitespace content waiting to see what follows it
        self._num_calls = 0
        self._after_call = False  # drop whitespace right after a call
        self.num_dropped = 0  # calls (or cut-off start tags) dropped as unusable markup

    @property
    def num_calls(self) -> int:
        return self._num_calls

    def feed(self, text: str) -> list[Event]:
        raise NotImplementedError

    def finish(self) -> list[Event]:
        raise NotImplementedError

    def _emit_content(self, text: str, events: list[Event]) -> None:
        for char in text:
            if char.isspace():
                if not self._after_call:
                    self._held_space += char
                continue
            self._after_call = False
            _append_content(events, self._held_space + char)
            self._held_space = ""

    requires_arguments = False

    def _start_call(self, scanner: CallScanner | None = None,
                    call_id: str | None = None) -> _CallEmitter:
        """`call_id`: the id the markup gives the call (Kimi K2), else a new one."""
        self._held_space = ""  # whitespace right before a call is dropped
        make_call_id = self._make_call_id if call_id is None else (lambda: call_id)
        return _CallEmitter(self._num_calls, make_call_id, self.requires_arguments, scanner)

    def _end_call(self) -> None:
        self._num_calls += 1
        self._after_call = True

    def _drop_markup(self) -> None:
        """A call that cannot be reported: neither a call nor content (nor the space around it)."""
        self.num_dropped += 1
        self._held_space = ""
        self._after_call = True

    def _flush_held_space(self, events: list[Event]) -> None:
        if self._held_space and self._num_calls == 0:
            _append_content(events, self._held_space)
        self._held_space = ""


def _append_content(events: list[Event], text: str) -> None:
    if events and isinstance(events[-1], str):
        events[-1] += text
    else:
        events.append(text)


class HermesToolParser(ToolParser):
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, make_call_id: Callable[[], str] = random_call_id) -> None:
        super().__init__(make_call_id)
        self._call: _CallEmitter | None = None

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
            keep = _partial_suffix(self._pending, self.START)
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
        body_len = at if at >= 0 else len(self._pending) - _partial_suffix(self._pending, self.END)
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


class Llama3JsonToolParser(ToolParser):
    PYTHON_TAG = "<|python_tag|>"
    requires_arguments = True

    def __init__(self, make_call_id: Callable[[], str] = random_call_id) -> None:
        super().__init__(make_call_id)
        self._mode = "start"  # start | call | between | content
        self._call: _CallEmitter | None = None

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


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for length in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0


def make_tool_parser(name: str, make_call_id: Callable[[], str] = random_call_id) -> ToolParser:
    # (imported here: tool_sections builds on this module's ToolParser)
    from hearth.server.tool_sections import SECTION_MARKUPS, SectionToolParser

    if name == "hermes":
        return HermesToolParser(make_call_id)
    if name == "llama3_json":
        return Llama3JsonToolParser(make_call_id)
    if name in SECTION_MARKUPS:
        return SectionToolParser(SECTION_MARKUPS[name], make_call_id)
    raise ValueError(f"unknown tool-call parser {name!r}; one of {', '.join(TOOL_PARSERS)}")


def tool_parser_for_template(chat_template: str | None) -> str:
    """Pick the parser a model family's template implies: the markers a template writes (Kimi K2,
    DeepSeek V3 / V3.1), Llama 3 headers -> llama3_json, else hermes."""
    from hearth.server.tool_sections import section_format_of_template

    if not chat_template:
        return "hermes"
    section_format = section_format_of_template(chat_template)
    if section_format is not None:
        return section_format
    if "<|start_header_id|>" in chat_template:
        return "llama3_json"
    return "hermes"


def assemble(events: list[Event]) -> tuple[str | None, list[ToolCall]]:
    """Fold events into (content, tool_calls), as a non-streaming response carries them."""
    content = "".join(e for e in events if isinstance(e, str))
    calls: dict[int, ToolCall] = {}
    for event in events:
        if isinstance(event, ToolCallDelta):
            if event.index not in calls:
                calls[event.index] = ToolCall(event.id or "", event.name or "", "")
            calls[event.index].arguments += event.arguments
    ordered = [calls[i] for i in sorted(calls)]
    if ordered and not content.strip():
        content = ""
    return (content or None), ordered

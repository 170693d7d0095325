"""What every tool-call format shares: `ToolParser` (the content and whitespace bookkeeping),
`CallEmitter` (one call's scanner progress -> ToolCallDeltas), the held-suffix rule and
`assemble`. Each format is a module of its own beside this one (hearth/server/tool_parsers/);
none imports another format, and this module imports none of them.

One parser object per request (per choice). `feed(text)` takes the next piece of output text and
returns events in output order: `str` for content, `ToolCallDelta` for tool calls. `finish()`
flushes what is held back at the end of the output.

The invariant every test checks: the events' content and the assembled calls depend only on the
concatenated text, never on how it was split into deltas. Every decision is made on text already
seen: a suffix that could still become a tag is held back until it is decided (`partial_suffix`),
and a call's header (id + name) goes out once its name is complete and its arguments have begun.

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
from hearth.server.tool_parsers.call_scanner import CallScanner


Event = Union[str, ToolCallDelta]


class CallEmitter:
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
    """Base: content/whitespace bookkeeping shared by the formats.

    A format sets `special_tokens` when its markup is special tokens of its models' vocabularies
    (the output text must then keep special tokens: the parser reads the markup and keeps it out
    of content), and answers `writes_template` for `--tool-call-parser auto`."""

    special_tokens = False

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

    @classmethod
    def writes_template(cls, chat_template: str) -> bool:
        """Whether `chat_template` writes this format's calls (what `auto` asks)."""
        return False

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
            append_content(events, self._held_space + char)
            self._held_space = ""

    requires_arguments = False

    def _start_call(self, scanner: CallScanner | None = None,
                    call_id: str | None = None) -> CallEmitter:
        """`call_id`: the id the markup gives the call (Kimi K2), else a new one."""
        self._held_space = ""  # whitespace right before a call is dropped
        make_call_id = self._make_call_id if call_id is None else (lambda: call_id)
        return CallEmitter(self._num_calls, make_call_id, self.requires_arguments, scanner)

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
            append_content(events, self._held_space)
        self._held_space = ""


def append_content(events: list[Event], text: str) -> None:
    if events and isinstance(events[-1], str):
        events[-1] += text
    else:
        events.append(text)


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for length in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0


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

"""`<think>...</think>` reasoning: the blocks Qwen3, QwQ and DeepSeek-R1 write before their answer.

One parser object per choice. `feed(text)` takes the next piece of output text and returns events
in output order: `ReasoningDelta` for reasoning, `str` for content (which the tool parser reads
next, when there is one). `finish()` flushes what is held back at the end of the output.

    output:   [ws] [<think>] reasoning... </think> [ws] content...
    deepseek_r1: the template opened the block, so output starts inside it; a leading <think>
                 (R1-0528 writes one again) is dropped. No </think>: all of it is reasoning.
    kimi_k2:     as deepseek_r1 (Kimi K2 Thinking), and a tool-call section
                 (<|tool_calls_section_begin|>) also ends the reasoning: the section and what
                 follows are content, for the kimi_k2 tool parser.
    qwen3:       a block only where the output starts with <think> (after whitespace), else all
                 of it is content.

The invariant every test checks: the events depend only on the concatenated text, never on how it
was split into deltas. A suffix that could still become a tag is held back until it is decided,
and so is the whitespace between `</think>` and the answer (dropped: content starts at its first
non-space character). A block cut off at the end of the output (max_tokens) keeps the reasoning
already produced as reasoning, in both modes, so a stream and its non-streamed twin agree.
Markup never reaches either side, and nothing a model writes makes the parser raise: a second
<think> or a stray </think> in the answer is content.
"""

from __future__ import annotations

from typing import Union

from hearth.api.reasoning import ReasoningDelta

ReasoningEvent = Union[str, ReasoningDelta]

START_TAG, END_TAG = "<think>", "</think>"
_OPENING, _REASONING, _AFTER, _CONTENT = "opening", "reasoning", "after", "content"


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for length in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0


class ThinkReasoningParser:
    """Base of the `<think>` formats; `starts_in_reasoning` is what sets them apart."""

    starts_in_reasoning = False
    content_parser: str | None = None  # the content is plain text: any tool parser reads it
    # markup that ends the reasoning but belongs to the content (read by the tool parser)
    content_markers: tuple[str, ...] = ()

    def __init__(self) -> None:
        self._state = _OPENING
        self._pending = ""  # text seen, not yet decided
        self._num_seen = 0  # characters fed so far
        # output offset right after the reasoning (its end tag included); None while inside it
        self._reasoning_end: int | None = None

    @property
    def in_reasoning(self) -> bool:
        return self._state == _REASONING or (self._state == _OPENING and self.starts_in_reasoning)

    @property
    def reasoning_end(self) -> int | None:
        """Characters of output that belong to the reasoning (markup included), once decided:
        None while the output may still be inside the block; the whole output at finish() when
        the block was never closed."""
        return self._reasoning_end

    def is_reasoning_at(self, offset: int) -> bool:
        """Whether the output's character at `offset` is reasoning (markup included); before
        the block is decided, everything counts as reasoning."""
        return self._reasoning_end is None or offset < self._reasoning_end

    def feed(self, text: str) -> list[ReasoningEvent]:
        self._num_seen += len(text)
        self._pending += text
        events: list[ReasoningEvent] = []
        self._advance(events)
        return events

    def finish(self) -> list[ReasoningEvent]:
        events: list[ReasoningEvent] = []
        pending, self._pending = self._pending, ""
        if self._state == _OPENING:
            self._state = _REASONING if self.starts_in_reasoning else _CONTENT
        if self._state == _REASONING:
            append_event(events, ReasoningDelta(pending))
            self._reasoning_end = self._num_seen
        elif self._state == _CONTENT:
            append_event(events, pending)
        if self._reasoning_end is None:
            self._reasoning_end = 0
        return events  # _AFTER: only whitespace was held, and it is dropped

    def _advance(self, events: list[ReasoningEvent]) -> None:
        if self._state == _OPENING:
            head = self._pending.lstrip()
            if START_TAG.startswith(head):  # "", or a part of the tag: not decided yet
                return
            if head.startswith(START_TAG):
                self._pending = head[len(START_TAG):]
                self._state = _REASONING
            elif self.starts_in_reasoning:
                self._state = _REASONING
            else:
                self._state, self._reasoning_end = _CONTENT, 0
        if self._state == _REASONING:
            ends = [(i, tag) for tag in (END_TAG, *self.content_markers)
                    if (i := self._pending.find(tag)) >= 0]
            if not ends:
                keep = max(partial_suffix(self._pending, tag)
                           for tag in (END_TAG, *self.content_markers))
                cut = len(self._pending) - keep
                append_event(events, ReasoningDelta(self._pending[:cut]))
                self._pending = self._pending[cut:]
                return
            end, tag = min(ends)
            append_event(events, ReasoningDelta(self._pending[:end]))
            self._pending = self._pending[end + (len(tag) if tag == END_TAG else 0):]
            self._reasoning_end = self._num_seen - len(self._pending)
            self._state = _AFTER if tag == END_TAG else _CONTENT
        if self._state == _AFTER:
            stripped = self._pending.lstrip()
            self._pending = ""
            if not stripped:
                return
            self._pending, self._state = stripped, _CONTENT
        if self._state == _CONTENT:
            append_event(events, self._pending)
            self._pending = ""


def append_event(events: list[ReasoningEvent], event: ReasoningEvent) -> None:
    """Add `event`, merged into the last one when both are content or both are reasoning."""
    text = event.text if isinstance(event, ReasoningDelta) else event
    if not text:
        return
    last = events[-1] if events else None
    if isinstance(event, ReasoningDelta) and isinstance(last, ReasoningDelta):
        last.text += text
    elif isinstance(event, str) and isinstance(last, str):
        events[-1] = last + text
    else:
        events.append(event)


class DeepSeekR1ReasoningParser(ThinkReasoningParser):
    """deepseek_r1: DeepSeek-R1 (and its distills, QwQ): output begins inside the block."""

    starts_in_reasoning = True


class Qwen3ReasoningParser(ThinkReasoningParser):
    """qwen3: a block only where the output opens one (enable_thinking off: none)."""

    starts_in_reasoning = False


class KimiK2ReasoningParser(ThinkReasoningParser):
    """kimi_k2: Kimi K2 Thinking, output begins inside the block, and a tool-call section may
    end it without </think> (vLLM's kimi_k2 reasoning parser does the same)."""

    starts_in_reasoning = True
    content_markers = ("<|tool_calls_section_begin|>",)

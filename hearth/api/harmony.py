"""OpenAI's harmony format (gpt-oss): its special tokens and an incremental reader of its messages.

A harmony message is

    <|start|>ROLE [to=RECIPIENT] <|channel|>CHANNEL [to=RECIPIENT] [<|constrain|>TYPE] <|message|>BODY END

where END is <|end|> (a message in history), <|call|> (a tool call: the turn stops) or <|return|>
(the last final answer). Channels: `analysis` (reasoning), `commentary` (tool calls, and
preambles the user may see), `final` (the answer). The prompt ends with `<|start|>assistant`, so
generated text starts at the header's `<|channel|>`.

`HarmonyReader` splits generated text into `Header` / `Body` / `End` events (and `Plain` text
that carries no markup). The header is everything before `<|message|>`; the reader reads its
channel and recipient from it wherever they stand (gpt-oss writes `to=` before or after the
channel). The events depend only on the concatenated text, never on how it was split: a suffix
that could still become a special token is held back. Nothing a model writes makes it raise:

    * a message slot whose text does not start with `<|` has no markup: `Plain` text up to the
      next special token (a grammar-forced JSON answer, a model that writes no channels);
    * `<|start|>` or `<|channel|>` inside a body ends that message (its END was left out);
    * a header that meets an END before `<|message|>`, or is cut off, is `Header(broken=True)`;
    * `<|message|>` and `<|constrain|>` inside a body are stray markup: dropped.

The reasoning parser and the `openai` tool parser both read output through it
(hearth/server/reasoning_parsers/harmony_parser.py, hearth/server/tool_parsers/openai_parser.py),
and the prompt renderer (harmony_prompt.py) writes what it reads.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Union

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL = "<|constrain|>", "<|return|>", "<|call|>"
SPECIAL_TOKENS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
ENDS = (END, CALL, RETURN)
FUNCTIONS_PREFIX = "functions."  # a recipient `functions.NAME` is a call of the client's NAME

_CHANNEL_RE = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")
_RECIPIENT_RE = re.compile(r"(?:^|\s|>)to=([^\s<]+)")
_CONSTRAIN_RE = re.compile(re.escape(CONSTRAIN) + r"\s*([^\s<]+)")


@dataclass
class Header:
    raw: str  # the header's text as generated, <|message|> included
    offset: int = 0  # where it starts in the output (characters)
    channel: str | None = None
    recipient: str | None = None  # e.g. "functions.get_weather"; None: to the user
    content_type: str | None = None  # after <|constrain|> (e.g. "json")
    broken: bool = False  # never reached <|message|>: no message follows

    @property
    def function_name(self) -> str | None:
        """The client function this message calls, if its recipient is one."""
        if self.recipient and self.recipient.startswith(FUNCTIONS_PREFIX):
            return self.recipient[len(FUNCTIONS_PREFIX):] or None
        return None

    @property
    def is_reasoning(self) -> bool:
        return not self.broken and self.channel == "analysis" and self.recipient is None


@dataclass
class Body:
    text: str  # never empty


@dataclass
class End:
    raw: str  # the END token, or "" (cut off, or ended by the next message's markup)
    offset: int = 0  # the output's characters up to the message's end (its END included)


@dataclass
class Plain:
    text: str  # text outside any message (no markup), never empty


HarmonyEvent = Union[Header, Body, End, Plain]


def parse_header(raw: str, offset: int = 0) -> Header:
    """The channel, recipient and content type a header names (None for those it lacks)."""
    channel = _CHANNEL_RE.search(raw)
    recipient = _RECIPIENT_RE.search(raw)
    constrain = _CONSTRAIN_RE.search(raw)
    return Header(raw, offset, channel.group(1) if channel else None,
                  recipient.group(1) if recipient else None,
                  constrain.group(1) if constrain else None)


def held_suffix(text: str, tokens: tuple[str, ...] = SPECIAL_TOKENS) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tokens`."""
    for length in range(min(len(text), max(map(len, tokens)) - 1), 0, -1):
        tail = text[-length:]
        if any(t.startswith(tail) and t != tail for t in tokens):
            return length
    return 0


def _first(text: str, tokens: tuple[str, ...]) -> tuple[int, str | None]:
    best_at, best = -1, None
    for token in tokens:
        at = text.find(token)
        if at >= 0 and (best is None or at < best_at):
            best_at, best = at, token
    return best_at, best


class HarmonyReader:
    """Generated text -> harmony events; `feed` as text arrives, `finish` at the end."""

    def __init__(self) -> None:
        self._mode = "slot"  # slot (a message may begin) | header | body | plain
        self._pending = ""
        self._num_read = 0  # characters of output consumed into events (markup included)

    def feed(self, text: str) -> list[HarmonyEvent]:
        self._pending += text
        events: list[HarmonyEvent] = []
        while self._pending and self._advance(events):
            pass
        return events

    def finish(self) -> list[HarmonyEvent]:
        events: list[HarmonyEvent] = []
        pending, self._pending = self._pending, ""
        start, self._num_read = self._num_read, self._num_read + len(pending)
        if self._mode == "header":
            events.append(Header(pending, start, broken=True))
        elif self._mode == "body":
            if pending:
                events.append(Body(pending))
            events.append(End("", self._num_read))
        elif pending:  # plain text, or a slot's one character ("<", say)
            events.append(Plain(pending))
        self._mode = "slot"
        return events

    def _advance(self, events: list[HarmonyEvent]) -> bool:
        """One decision on the pending text; False when it must wait for more."""
        if self._mode == "slot":
            if len(self._pending) < 2:
                return False
            self._mode = "header" if self._pending.startswith("<|") else "plain"
            return True
        if self._mode == "header":
            at, token = _first(self._pending, (MESSAGE, *ENDS))
            if token is None:
                return False
            raw, self._pending = self._pending[:at + len(token)], self._pending[at + len(token):]
            start, self._num_read = self._num_read, self._num_read + len(raw)
            if token == MESSAGE:
                events.append(parse_header(raw, start))
                self._mode = "body"
            else:
                events.append(Header(raw, start, broken=True))
                self._mode = "slot"
            return True
        return self._scan_text(events, Body if self._mode == "body" else Plain)

    def _scan_text(self, events: list[HarmonyEvent], kind: type) -> bool:
        at, token = _first(self._pending, SPECIAL_TOKENS)
        if token is None:
            cut = len(self._pending) - held_suffix(self._pending)
            if cut:
                events.append(kind(self._pending[:cut]))
            self._pending, self._num_read = self._pending[cut:], self._num_read + cut
            return False
        if at:
            events.append(kind(self._pending[:at]))
        rest = self._pending[at + len(token):]
        if token in (MESSAGE, CONSTRAIN):  # stray markup inside text
            self._pending, self._num_read = rest, self._num_read + at + len(token)
            return True
        if token in ENDS:
            self._pending, self._mode = rest, "slot"
            self._num_read += at + len(token)
        else:  # <|start|> / <|channel|>: the next message's header begins here
            self._pending, self._mode = self._pending[at:], "header"
            self._num_read += at
        if kind is Body:
            events.append(End(token if token in ENDS else "", self._num_read))
        return True

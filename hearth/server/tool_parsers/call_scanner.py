"""Incremental scanner of one JSON tool-call object: `{"name": ..., "arguments": {...}}`.

It tracks only nesting depth and string/escape state, char by char, and records where the
top-level "name" string and the "arguments"/"parameters" value lie in the text seen so far.
What it reports depends only on that text, never on how it arrived, which is what makes the
tool parsers' output independent of delta sizes. It does not validate JSON (a grammar does that
when the output is constrained).
"""

from __future__ import annotations

import json

ARGUMENT_KEYS = ("arguments", "parameters")


class CallScanner:
    """Scans one JSON call object char by char, tracking nesting and string state only.

    It finds the top-level "name" string and the "arguments"/"parameters" value; it does not
    validate JSON (a grammar does that when the output is constrained).
    """

    def __init__(self) -> None:
        self.text = ""
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.done = False
        self.expect = "key"  # at depth 1: key | colon | value | comma
        self.key: str | None = None
        self.string_start = -1
        self.name: str | None = None
        self.args_start = -1  # index in text of the arguments value's first char
        self.args_end = -1  # index one past its last char, once known
        self.args_is_container = False

    def feed(self, chunk: str) -> int:
        """Consume chars until the object closes; returns how many chars were consumed."""
        for offset, char in enumerate(chunk):
            self.text += char
            self._step(char, len(self.text) - 1)
            if self.done:
                return offset + 1
        return len(chunk)

    def _step(self, char: str, pos: int) -> None:
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif char == "\\":
                self.escaped = True
            elif char == '"':
                self.in_string = False
                if self.depth == 1:
                    self._on_top_level_string(pos)
            return
        if char == '"':
            self.in_string = True
            self.string_start = pos
            if self.depth == 1 and self.expect == "value":
                self._begin_value(pos, container=False)
        elif char in "{[":
            if self.depth == 1 and self.expect == "value":
                self._begin_value(pos, container=True)
            self.depth += 1
        elif char in "}]":
            self.depth -= 1
            if self.depth == 1 and self.args_is_container and self.args_end < 0:
                self.args_end = pos + 1
            if self.depth <= 0:
                self._end_primitive_args(pos)
                self.done = True
        elif self.depth == 1:
            self._top_level_punctuation(char, pos)

    def _top_level_punctuation(self, char: str, pos: int) -> None:
        if char == ":" and self.expect == "colon":
            self.expect = "value"
        elif char == ",":
            self._end_primitive_args(pos)
            self.expect = "key"
        elif not char.isspace() and self.expect == "value":
            self._begin_value(pos, container=False)  # number / true / false / null

    def _begin_value(self, pos: int, container: bool) -> None:
        self.expect = "comma"
        if self.key in ARGUMENT_KEYS and self.args_start < 0:
            self.args_start = pos
            self.args_is_container = container

    def _end_primitive_args(self, pos: int) -> None:
        if self.args_start >= 0 and self.args_end < 0 and not self.args_is_container:
            self.args_end = pos

    def _on_top_level_string(self, pos: int) -> None:
        raw = self.text[self.string_start : pos + 1]
        if self.expect == "key":
            self.key = _decode_json_string(raw)
            self.expect = "colon"
        elif self.key == "name" and self.name is None and self.string_start != self.args_start:
            self.name = _decode_json_string(raw)
        if self.string_start == self.args_start:
            self.args_end = pos + 1

    @classmethod
    def for_arguments(cls, name: str | None) -> CallScanner:
        """A scanner for a bare arguments value whose name came from markup around it (Kimi K2,
        DeepSeek): it reads what it is fed as the "arguments" value of a call object, so the
        arguments stream exactly as a Hermes call's do. `name` None: a call without a usable name."""
        scanner = cls()
        prefix = "{" + ("" if name is None else '"name": ' + json.dumps(name) + ", ")
        scanner.feed(prefix + '"arguments": ')
        return scanner

    @property
    def args_started(self) -> bool:
        return self.args_start >= 0

    def args_text_ready(self) -> str:
        """The arguments text known to be final so far (containers stream, primitives don't)."""
        if self.args_start < 0:
            return ""
        if self.args_end >= 0:
            return self.text[self.args_start : self.args_end].strip()
        if self.args_is_container:
            return self.text[self.args_start :]
        return ""

    def final_arguments(self) -> str:
        """Arguments as OpenAI carries them: JSON text ("{}" when absent or null)."""
        raw = self.args_text_ready()
        if not raw or raw == "null":
            return "{}"
        if raw.startswith('"'):
            return _decode_json_string(raw) or "{}"  # arguments given as a JSON-encoded string
        return raw


def _decode_json_string(raw: str) -> str | None:
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, str) else None

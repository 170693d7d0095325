"""openai: gpt-oss's tool calls, harmony messages addressed to a client function.

    <|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{"city":"Paris"}<|call|>

(gpt-oss also writes the recipient before the channel: `<|start|>assistant to=functions.NAME
<|channel|>commentary json<|message|>`.) The message body is the call's arguments, streamed as it
comes, verbatim: the parser does not check the JSON (a grammar does, when the call is forced; a
call with broken JSON is reported as written, as OpenAI's API allows). Messages are read through
hearth/api/harmony.py's `HarmonyReader`:

    final / commentary without a recipient (a preamble) / text without markup  -> content
    to=functions.NAME (any channel)                                              -> a tool call
    analysis without a recipient   -> dropped (the harmony reasoning parser takes these out first)
    any other recipient (a built-in tool: browser.*, python) or a header that never reached
    <|message|>                    -> dropped, counted in num_dropped

Markup never reaches content. A call cut off (max_tokens) keeps the arguments produced so far;
one with no arguments at all gets "{}".
"""

from __future__ import annotations

from typing import Callable

from hearth.api.harmony import CHANNEL, START, Body, End, Header, HarmonyReader, Plain
from hearth.api.tool_calls import ToolCallDelta, random_call_id
from hearth.server.tool_parsers.parser_base import Event, ToolParser


class OpenAIToolParser(ToolParser):
    special_tokens = True  # the harmony markup is special tokens of gpt-oss's vocabulary

    def __init__(self, make_call_id: Callable[[], str] = random_call_id) -> None:
        super().__init__(make_call_id)
        self._reader = HarmonyReader()
        self._message = "none"  # content | call | skip | none: what the current body is
        self._args_sent = False  # the current call has sent arguments
        self._args_space = ""  # whitespace inside the arguments, held until text follows it

    @classmethod
    def writes_template(cls, chat_template: str) -> bool:
        return CHANNEL in chat_template and START in chat_template  # harmony's messages

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = []
        for event in self._reader.feed(text):
            self._read(event, events)
        return events

    def finish(self) -> list[Event]:
        events: list[Event] = []
        for event in self._reader.finish():
            self._read(event, events)
        self._flush_held_space(events)
        return events

    def _read(self, event: Header | Body | End | Plain, events: list[Event]) -> None:
        if isinstance(event, Plain):
            self._emit_content(event.text, events)
        elif isinstance(event, Header):
            self._open(event, events)
        elif isinstance(event, Body):
            if self._message == "content":
                self._emit_content(event.text, events)
            elif self._message == "call":
                self._send_arguments(event.text, events)
        elif isinstance(event, End):
            if self._message == "call":
                if not self._args_sent:
                    events.append(ToolCallDelta(self._num_calls, arguments="{}"))
                self._end_call()
            self._message = "none"

    def _open(self, header: Header, events: list[Event]) -> None:
        name = header.function_name
        if header.broken or (header.recipient is not None and name is None):
            self._message = "skip"
            self._drop_markup()
        elif name is not None:
            self._message, self._args_sent, self._args_space = "call", False, ""
            emitter = self._start_call()  # its index and id; the body is the arguments
            events.append(ToolCallDelta(emitter.index, id=emitter.call_id, name=name))
        elif header.channel == "analysis":
            self._message = "skip"
        else:
            self._message = "content"

    def _send_arguments(self, text: str, events: list[Event]) -> None:
        """Stream the body, without the whitespace around it."""
        text = self._args_space + (text if self._args_sent else text.lstrip())
        body = text.rstrip()
        self._args_space = text[len(body):]
        if body:
            events.append(ToolCallDelta(self._num_calls, arguments=body))
            self._args_sent = True

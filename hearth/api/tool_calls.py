"""A tool call as the APIs carry it: whole (`ToolCall`) or streamed (`ToolCallDelta`).

The worker's tool parsers (hearth/server/tool_parsers/) produce them; the chat chunks, the
Responses and Messages writers and the router's chunk reader consume them.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass


def random_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass
class ToolCallDelta:
    index: int  # position of the call in message.tool_calls
    id: str | None = None  # set on the call's first delta only
    name: str | None = None  # set on the call's first delta only
    arguments: str = ""  # the next fragment of the arguments JSON text


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text

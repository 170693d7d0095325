"""A piece of the model's reasoning, as every output stream carries it apart from content.

Reasoning parsers (hearth/server/reasoning_parsers/) produce it from `<think>` blocks; the Chat
API writes it as `reasoning_content`, the Responses API as a `reasoning` output item, Anthropic
Messages as a `thinking` content block.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ReasoningDelta:
    text: str  # never empty

"""Response bodies and stream chunks, as plain dicts in the exact OpenAI shapes.

Chat chunk:        {"id", "object": "chat.completion.chunk", "created", "model",
                    "choices": [{"index", "delta": {...}, "logprobs", "finish_reason"}]}
Completion chunk:  {"id", "object": "text_completion", "created", "model",
                    "choices": [{"index", "text", "logprobs", "finish_reason"}]}
With `return_token_ids` (vLLM's placement): a choice's `token_ids`; the prompt's
`prompt_token_ids` on the chat role chunk (top level) or a completion choice's first chunk.
Usage:             {"prompt_tokens", "completion_tokens", "total_tokens",
                    "prompt_tokens_details": {"cached_tokens"},
                    "completion_tokens_details": {"reasoning_tokens"} (with a reasoning parser)}
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from hearth.engine.request import Logprob
from hearth.engine.text.tiktoken_folder import byte_level_alphabet
from hearth.api.tool_calls import ToolCall, ToolCallDelta


def sse(payload: dict) -> str:
    return "data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")) + "\n\n"


SSE_DONE = "data: [DONE]\n\n"


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int | None = None  # of completion_tokens; None: no reasoning parser

    def to_dict(self) -> dict:
        usage = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }
        if self.reasoning_tokens is not None:
            usage["completion_tokens_details"] = {"reasoning_tokens": self.reasoning_tokens}
        return usage


_UNICODE_TO_BYTE = {char: byte for byte, char in byte_level_alphabet().items()}


class TokenTexts:
    """A token id's text and exact bytes (byte-level pieces can be partial UTF-8)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.text = lru_cache(maxsize=65536)(self._text)
        self.bytes = lru_cache(maxsize=65536)(self._bytes)

    def _text(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    def _bytes(self, token_id: int) -> list[int]:
        piece = self._tokenizer.id_to_token(token_id) or ""
        if piece and all(char in _UNICODE_TO_BYTE for char in piece):
            return [_UNICODE_TO_BYTE[char] for char in piece]
        return list(self._text(token_id).encode("utf-8"))


def chat_logprobs(entries: list[Logprob], texts: TokenTexts) -> dict:
    """choice.logprobs of the Chat API: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    content = []
    for entry in entries:
        content.append({
            "token": texts.text(entry.token_id),
            "logprob": entry.logprob,
            "bytes": texts.bytes(entry.token_id),
            "top_logprobs": [
                {"token": texts.text(tid), "logprob": lp, "bytes": texts.bytes(tid)} for tid, lp in entry.top
            ],
        })
    return {"content": content, "refusal": None}


def completion_logprobs(entries: list[Logprob], texts: TokenTexts, text_offset: int) -> dict:
    """choice.logprobs of the legacy Completions API."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for entry in entries:
        token = texts.text(entry.token_id)
        tokens.append(token)
        token_logprobs.append(entry.logprob)
        top.append({texts.text(tid): lp for tid, lp in entry.top} if entry.top else None)
        offsets.append(text_offset)
        text_offset += len(token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
            "text_offset": offsets}


def tool_call_delta(delta: ToolCallDelta) -> dict:
    if delta.id is not None:  # a call's first delta: id, type and name, empty arguments
        return {"index": delta.index, "id": delta.id, "type": "function",
                "function": {"name": delta.name, "arguments": delta.arguments}}
    return {"index": delta.index, "function": {"arguments": delta.arguments}}


def tool_call_message(call: ToolCall) -> dict:
    return {"id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


class ChunkMaker:
    """Builds the chunks of one streamed response (one id, one created time)."""

    def __init__(self, response_id: str, created: int, model: str, chat: bool,
                 include_usage: bool) -> None:
        self.response_id, self.created, self.model = response_id, created, model
        self.object = "chat.completion.chunk" if chat else "text_completion"
        self.include_usage = include_usage

    def _envelope(self, choices: list[dict]) -> dict:
        chunk = {"id": self.response_id, "object": self.object, "created": self.created,
                 "model": self.model, "choices": choices}
        if self.object == "chat.completion.chunk":
            chunk["system_fingerprint"] = None
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def chat(self, index: int, delta: dict, logprobs: dict | None = None,
             finish_reason: str | None = None, stop_reason: str | None = None,
             token_ids: list[int] | None = None, prompt_token_ids: list[int] | None = None) -> str:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        if stop_reason is not None:  # vLLM's extension: which stop string ended the output
            choice["stop_reason"] = stop_reason
        if token_ids is not None:  # return_token_ids: the ids new since the choice's last chunk
            choice["token_ids"] = token_ids
        chunk = self._envelope([choice])
        if prompt_token_ids is not None:
            chunk["prompt_token_ids"] = prompt_token_ids
        return sse(chunk)

    def text(self, index: int, text: str, logprobs: dict | None = None,
             finish_reason: str | None = None, token_ids: list[int] | None = None,
             prompt_token_ids: list[int] | None = None) -> str:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        if prompt_token_ids is not None:
            choice["prompt_token_ids"] = prompt_token_ids
        if token_ids is not None:
            choice["token_ids"] = token_ids
        return sse(self._envelope([choice]))

    def usage(self, usage: Usage) -> str:
        chunk = self._envelope([])
        chunk["usage"] = usage.to_dict()
        return sse(chunk)


def error_event(message: str, type: str = "internal_server_error", code: str | None = None) -> str:
    """A stream that fails after its first byte ends with an error event, then [DONE]."""
    return sse({"error": {"message": message, "type": type, "param": None, "code": code}})

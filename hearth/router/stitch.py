"""SSE stitching: one OpenAI response out of a prefill hop's first token and a decode stream.

The client must not be able to tell a stitched response from a monolithic worker's:
  * one `id`, one `created`, one `model` on every chunk; exactly one role chunk (chat), first;
  * the first token is sent as soon as the prefill hop returns it; the decode stream continues
    after it (the decode worker's own role chunk is dropped);
  * usage: `prompt_tokens` and `prompt_tokens_details.cached_tokens` from the side that computed
    the prompt, `completion_tokens` from the decode side (which counts the first token once);
  * tool-call deltas pass through unchanged (index, id and name first, then argument fragments);
  * a resumed stream (the remainder re-run on another decode endpoint after a failure, or a
    resume hop that replays the output ids already received) skips exactly what was already
    sent: content characters, tool-call headers and argument characters, logprob entries and
    token ids; so the client sees one uninterrupted stream;
  * the hops are asked for `token_ids` (docs/pd_protocol.md) so that a stream can be resumed
    from them: the stitcher records them (and the prompt's ids) and passes them on only when
    the client asked for them itself (`return_token_ids`).

Everything here is synchronous and pure of I/O: the orchestrator feeds parsed events in and
writes the returned SSE strings out, and the tests feed recorded chunk sequences.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

SSE_DONE = "data: [DONE]\n\n"
DONE = object()  # parse_sse_data's marker for `data: [DONE]`


def sse(payload: dict) -> str:
    return "data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")) + "\n\n"


def error_payload(message: str, type: str = "internal_server_error", code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": None, "code": code}}


def parse_sse_data(line: str) -> Any:
    """A `data:` line's JSON, DONE, or None for anything else (comments, blank lines)."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return DONE
    return json.loads(data)


@dataclass
class FirstToken:
    """What the prefill hop returned, reduced to what the client stream needs."""

    text: str  # chat: message.content as the monolithic stream would have sent it; completions: text
    logprobs: dict | None  # choices[0].logprobs of the prefill response (None unless asked)
    num_prompt_tokens: int
    num_cached_tokens: int
    token_ids: list[int] | None = None  # with return_token_ids: [the first token]
    prompt_token_ids: list[int] | None = None
    reasoning: str = ""  # chat with --reasoning-parser: message.reasoning_content of the hop

    @classmethod
    def from_response(cls, body: dict, chat: bool) -> "FirstToken":
        choice = body["choices"][0]
        text = (choice.get("message") or {}).get("content") if chat else choice.get("text")
        usage = body.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        prompt_ids = body.get("prompt_token_ids") if chat else choice.get("prompt_token_ids")
        reasoning = (choice.get("message") or {}).get("reasoning_content") if chat else None
        return cls(text or "", choice.get("logprobs"), int(usage.get("prompt_tokens", 0)),
                   int(details.get("cached_tokens", 0)), choice.get("token_ids"), prompt_ids,
                   reasoning or "")


@dataclass
class ChoiceState:
    """What was sent to the client for one choice index (and what a resume must skip)."""

    content: str = ""
    tool_calls: dict[int, dict] = field(default_factory=dict)  # index -> {id, type, function}
    num_logprobs: int = 0  # chat: logprob entries sent; completions: tokens sent
    logprobs: dict | None = None  # accumulated, for the non-streamed body
    finish_reason: str | None = None
    # Resume: what the replacement stream must skip before anything new is sent.
    skip_content: int = 0
    skip_args: dict[int, int] = field(default_factory=dict)
    skip_logprobs: int = 0
    text_offset_shift: int = 0  # completions: decode offsets start after the first token
    token_ids: list[int] = field(default_factory=list)  # output ids received (return_token_ids)
    skip_ids: int = 0


class Stitcher:
    def __init__(self, response_id: str, created: int, model: str, chat: bool,
                 include_usage: bool, pass_token_ids: bool = False) -> None:
        self.response_id, self.created, self.model = response_id, created, model
        self.chat, self.include_usage = chat, include_usage
        self.pass_token_ids = pass_token_ids  # the client asked for return_token_ids itself
        self.prompt_token_ids: list[int] | None = None  # as the first worker reported them
        self.choices: dict[int, ChoiceState] = {}
        self.first: FirstToken | None = None
        self.decode_usage: dict | None = None
        self._sent_role: set[int] = set()

    # ---- chunks out ---------------------------------------------------------------------------
    def _envelope(self, choices: list[dict]) -> dict:
        chunk = {"id": self.response_id, "object": "chat.completion.chunk" if self.chat
                 else "text_completion", "created": self.created, "model": self.model,
                 "choices": choices}
        if self.chat:
            chunk["system_fingerprint"] = None
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def _choice(self, index: int) -> ChoiceState:
        return self.choices.setdefault(index, ChoiceState())

    def role_chunk(self, index: int = 0) -> list[str]:
        if not self.chat or index in self._sent_role:
            return []
        self._sent_role.add(index)
        delta = {"role": "assistant", "content": ""}
        return [sse(self._envelope([{"index": index, "delta": delta, "logprobs": None,
                                     "finish_reason": None}]))]

    def prefill_chunks(self, first: FirstToken) -> list[str]:
        """The role chunk and the first token, the moment the prefill hop answers."""
        self.first = first
        state = self._choice(0)
        state.text_offset_shift = len(first.text)
        if first.prompt_token_ids is not None:
            self.prompt_token_ids = list(first.prompt_token_ids)
        out = self.role_chunk(0)
        ids = list(first.token_ids or ())
        state.token_ids += ids
        if not (first.text or first.reasoning) and not first.logprobs \
                and not (ids and self.pass_token_ids):
            return out
        if self.chat:
            delta = {"reasoning_content": first.reasoning} if first.reasoning else {}
            choice = {"index": 0, "delta": {**delta, "content": first.text},
                      "logprobs": first.logprobs, "finish_reason": None}
        else:
            choice = {"index": 0, "text": first.text, "logprobs": first.logprobs, "finish_reason": None}
        if self.pass_token_ids:
            choice["token_ids"] = ids
        self._record(state, choice)
        out.append(sse(self._envelope([choice])))
        return out

    def decode_event(self, event: dict) -> list[str]:
        """Rewrite one parsed chunk of the decode stream into zero or more client chunks."""
        if "usage" in event and event["usage"] and not event.get("choices"):
            self.decode_usage = event["usage"]
            return []
        if self.prompt_token_ids is None and event.get("prompt_token_ids") is not None:
            self.prompt_token_ids = list(event["prompt_token_ids"])  # chat: on the role chunk
        out = []
        for choice in event.get("choices") or ():
            rewritten = self._rewrite_choice(dict(choice))
            if rewritten is not None:
                out += self.role_chunk(rewritten["index"])
                out.append(sse(self._envelope([rewritten])))
        return out

    def done_chunks(self) -> list[str]:
        out = [sse({**self._envelope([]), "usage": self.usage()})] if self.include_usage else []
        return out + [SSE_DONE]

    def error_chunks(self, message: str, type: str = "internal_server_error",
                     code: str | None = None) -> list[str]:
        """A stream that fails after its first byte ends with an error event, then [DONE]."""
        return [sse(error_payload(message, type, code)), SSE_DONE]

    # ---- rewriting ----------------------------------------------------------------------------
    def _rewrite_choice(self, choice: dict) -> dict | None:
        index = int(choice.get("index", 0))
        state = self._choice(index)
        prompt_ids = choice.pop("prompt_token_ids", None)  # completions: on the first chunk
        if prompt_ids is not None and self.prompt_token_ids is None:
            self.prompt_token_ids = list(prompt_ids)
        new_ids = self._take_ids(state, choice.pop("token_ids", None))
        if self.pass_token_ids and new_ids is not None:
            choice["token_ids"] = new_ids
        if self.chat:
            delta = dict(choice.get("delta") or {})
            delta.pop("role", None)
            self._skip_chat(state, delta, choice)
            choice["delta"] = delta
            empty = not (delta.get("content") or delta.get("tool_calls")
                         or delta.get("reasoning_content"))
        else:
            self._skip_text(state, choice)
            empty = not choice.get("text")
        carries_ids = bool(self.pass_token_ids and new_ids)
        if empty and not choice.get("finish_reason") and not choice.get("logprobs") \
                and not carries_ids:
            return None
        if self.chat and not delta and not choice.get("finish_reason") and not carries_ids:
            return None  # the decode side's own role chunk
        self._record(state, choice)
        return choice

    @staticmethod
    def _take_ids(state: ChoiceState, ids: list | None) -> list[int] | None:
        """Record a chunk's token ids minus those a resume replays; the new ones."""
        if ids is None:
            return None
        cut = min(len(ids), state.skip_ids)
        state.skip_ids -= cut
        new = [int(i) for i in ids[cut:]]
        state.token_ids += new
        return new

    def output_token_ids(self) -> list[int] | None:
        """Choice 0's output ids so far (what a resume hop replays); None if the hops did not
        report ids (a worker without return_token_ids)."""
        state = self.choices.get(0)
        if state is None:
            return []
        if not state.token_ids and (state.content or state.tool_calls):
            return None
        return list(state.token_ids)

    def _skip_chat(self, state: ChoiceState, delta: dict, choice: dict) -> None:
        content = delta.get("content")
        if content and state.skip_content:
            cut = min(len(content), state.skip_content)
            state.skip_content -= cut
            delta["content"] = content[cut:]
            if not delta["content"]:
                delta.pop("content")
        calls = []
        for call in delta.get("tool_calls") or ():
            call = _skip_call(state, call)
            if call is not None:
                calls.append(call)
        if "tool_calls" in delta:
            if calls:
                delta["tool_calls"] = calls
            else:
                delta.pop("tool_calls")
        logprobs = choice.get("logprobs")
        if logprobs and state.skip_logprobs and logprobs.get("content"):
            entries = logprobs["content"]
            cut = min(len(entries), state.skip_logprobs)
            state.skip_logprobs -= cut
            choice["logprobs"] = {**logprobs, "content": entries[cut:]} if entries[cut:] else None

    def _skip_text(self, state: ChoiceState, choice: dict) -> None:
        text = choice.get("text") or ""
        if state.skip_content:
            cut = min(len(text), state.skip_content)
            state.skip_content -= cut
            choice["text"] = text[cut:]
        logprobs = choice.get("logprobs")
        if not logprobs:
            return
        cut = min(len(logprobs.get("tokens") or ()), state.skip_logprobs)
        state.skip_logprobs -= cut
        shifted = {key: list(logprobs.get(key) or ())[cut:] for key in
                   ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
        shifted["text_offset"] = [o + state.text_offset_shift for o in shifted["text_offset"]]
        choice["logprobs"] = shifted if shifted["tokens"] else None

    def _record(self, state: ChoiceState, choice: dict) -> None:
        """Remember what went out: it is what a resume skips and what a non-streamed body holds."""
        if choice.get("finish_reason"):
            state.finish_reason = choice["finish_reason"]
        if self.chat:
            delta = choice.get("delta") or {}
            state.content += delta.get("content") or ""
            for call in delta.get("tool_calls") or ():
                _merge_call(state.tool_calls, call)
        else:
            state.content += choice.get("text") or ""
        state.logprobs = _merge_logprobs(state.logprobs, choice.get("logprobs"), self.chat)
        if state.logprobs is not None:
            entries = state.logprobs.get("content" if self.chat else "tokens") or ()
            state.num_logprobs = len(entries)

    # ---- resume, usage, non-streamed body -----------------------------------------------------
    def resume(self) -> None:
        """A replacement stream that starts from the beginning of the output follows: skip what
        was sent. Offsets of a replacement stream are absolute, so no shift applies."""
        for state in self.choices.values():
            state.skip_content = len(state.content)
            state.skip_args = {i: len(c["function"]["arguments"]) for i, c in state.tool_calls.items()}
            state.skip_logprobs = state.num_logprobs
            state.skip_ids = len(state.token_ids)
            state.text_offset_shift = 0

    def has_output(self) -> bool:
        return any(s.content or s.tool_calls or s.num_logprobs for s in self.choices.values())

    def reset(self, keep_first: bool) -> None:
        """Forget what was recorded: a non-streamed response retried before anything was sent
        (keeping the prefill hop's first token, or not when the retry re-runs everything)."""
        first = self.first
        self.choices, self._sent_role, self.decode_usage, self.first = {}, set(), None, None
        if keep_first and first is not None:
            self.prefill_chunks(first)

    def usage(self) -> dict:
        decode = self.decode_usage or {}
        completion = int(decode.get("completion_tokens", 0))
        if self.first is not None:
            prompt, cached = self.first.num_prompt_tokens, self.first.num_cached_tokens
        else:
            prompt = int(decode.get("prompt_tokens", 0))
            cached = int((decode.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def body(self) -> dict:
        """The non-streamed response equivalent to everything stitched so far."""
        choices = []
        for index in sorted(self.choices):
            state = self.choices[index]
            if self.chat:
                calls = [state.tool_calls[i] for i in sorted(state.tool_calls)]
                content = state.content
                if calls and not content.strip():
                    content = ""
                message: dict[str, Any] = {"role": "assistant", "content": content or None,
                                           "refusal": None}
                if calls:
                    message["tool_calls"] = calls
                choices.append({"index": index, "message": message, "logprobs": state.logprobs,
                                "finish_reason": state.finish_reason})
            else:
                choices.append({"index": index, "text": state.content, "logprobs": state.logprobs,
                                "finish_reason": state.finish_reason})
        return {"id": self.response_id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices,
                "system_fingerprint": None, "usage": self.usage()}


def _skip_call(state: ChoiceState, call: dict) -> dict | None:
    """A tool-call delta minus the part a resumed stream already sent (None if nothing is new)."""
    index = int(call.get("index", 0))
    if index not in state.skip_args:
        return call
    call = dict(call)
    for key in ("id", "type"):
        call.pop(key, None)  # the header went out with the original call id
    function = dict(call.get("function") or {})
    function.pop("name", None)
    args = function.get("arguments") or ""
    cut = min(len(args), state.skip_args[index])
    state.skip_args[index] -= cut
    if not args[cut:]:
        return None
    function["arguments"] = args[cut:]
    call["function"] = function
    return call


def _merge_call(calls: dict[int, dict], call: dict) -> None:
    index = int(call.get("index", 0))
    function = call.get("function") or {}
    if index not in calls:
        calls[index] = {"id": call.get("id") or "", "type": call.get("type") or "function",
                        "function": {"name": function.get("name") or "", "arguments": ""}}
    calls[index]["function"]["arguments"] += function.get("arguments") or ""


def _merge_logprobs(total: dict | None, new: dict | None, chat: bool) -> dict | None:
    if not new:
        return total
    if chat:
        entries = (total or {}).get("content", []) + list(new.get("content") or ())
        return {"content": entries, "refusal": None}
    total = total or {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    return {key: total[key] + list(new.get(key) or ()) for key in total}

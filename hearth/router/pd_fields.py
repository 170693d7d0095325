"""The router's side of the `kv_transfer` hops: request bodies and the prefill hop's result.

The field itself is the workers' own types (hearth/api/pd_protocol.py: PrefillHop,
PrefillResult, DecodeHop, all torch-free), so router and worker cannot drift apart;
docs/pd_protocol.md has the exchange.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import msgspec

from hearth.api.pd_protocol import (DecodeHop, PrefillHop, decode_hop, parse_prefill_result,
                                      resume_hop)
from hearth.router.hops import HopError
from hearth.router.stitch import FirstToken


@dataclass
class PrefillDone:
    endpoint: str
    body: dict  # the prefill hop's response
    first: FirstToken
    kv_transfer: DecodeHop | None  # the decode hop's field; None: the first token ended it

    @classmethod
    def from_response(cls, endpoint: str, body: dict, chat: bool) -> "PrefillDone":
        """Raises HopError for a response that is not a prefill hop's (a worker's bug)."""
        try:
            first = FirstToken.from_response(body, chat)
            finish = body["choices"][0].get("finish_reason")
            ended = finish not in (None, "length") or "kv_transfer" not in body
            kv = None if ended else decode_hop(parse_prefill_result(body["kv_transfer"]))
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise HopError(endpoint, f"malformed prefill response: {exc}", eject=False) from None
        return cls(endpoint, body, first, kv)

    @property
    def finish_reason(self) -> str | None:
        return self.body["choices"][0].get("finish_reason")

    @property
    def finished(self) -> bool:
        """The first token ended the output (EOS, stop string): no decode hop is needed."""
        return self.kv_transfer is None


def prefill_body(raw: dict, token_ids: bool = False) -> dict:
    """The client's body as a prefill hop: one token, not streamed, a fresh lease key
    (`token_ids`: ask for the ids behind the text, which a later resume needs)."""
    body = {k: v for k, v in raw.items() if k not in ("max_completion_tokens", "stream_options")}
    body.update(stream=False, max_tokens=1, n=1,
                kv_transfer=msgspec.to_builtins(PrefillHop(transfer_id=uuid.uuid4().hex)))
    if token_ids:
        body["return_token_ids"] = True
    return body


def decode_body(raw: dict, kv_transfer: DecodeHop | None, token_ids: bool = False) -> dict:
    """The client's body as a decode hop (or a plain run when `kv_transfer` is None): always
    streamed with usage, which the stitcher needs, whatever the client asked; with
    `token_ids` the stream carries the ids behind its text (docs/pd_protocol.md)."""
    body = dict(raw)
    body.update(stream=True, stream_options={"include_usage": True})
    if token_ids:
        body["return_token_ids"] = True
    if kv_transfer is not None:
        body["kv_transfer"] = msgspec.to_builtins(kv_transfer)
    return body


def resume_body(raw: dict, output_token_ids: list[int], prompt_token_ids: list[int] | None) -> dict:
    """The client's body continuing on another worker from the output ids it already has
    (the resume hop): any sampling, grammar replayed; the stream re-sends their text first."""
    body = decode_body(raw, None, token_ids=True)
    body["kv_transfer"] = resume_hop(output_token_ids, prompt_token_ids)
    return body


def finish_chunk(chat: bool, prefill: PrefillDone) -> dict:
    """The final chunk of an output the prefill hop's first token already ended."""
    choice: dict = {"index": 0, "logprobs": None, "finish_reason": prefill.finish_reason}
    choice.update({"delta": {}} if chat else {"text": ""})
    return {"choices": [choice]}

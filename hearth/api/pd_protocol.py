"""The `kv_transfer` extension field of the OpenAI request/response bodies (router <-> worker).

One msgspec type per hop and direction, used by both ends: the worker parses and writes them,
the router (which imports this module; it is torch-free) reads the prefill hop's result and
writes the decode hop's request. Pure functions between JSON values and these types, so the
server and router wiring is a few lines. See docs/pd_protocol.md for the whole exchange.

    prefill hop request:   "kv_transfer": PrefillHop {"role": "prefill", "transfer_id": "..."}
                                          (max_tokens=1)
    prefill hop response:  "kv_transfer": PrefillResult (first token, counts, descriptor)
    decode hop request:    "kv_transfer": DecodeHop {"role": "decode", "prompt_token_ids": [...],
                                          "first_token_id": N, "descriptor": {...}}
    decode hop response:   "kv_transfer": DecodeResult (what crossed the wire), final chunk
    resume hop request:    "kv_transfer": ResumeHop {"role": "resume", "output_token_ids": [...],
                                          "prompt_token_ids": [...] (optional)}
                                          (any worker but a prefill one; no kv_transfer back)
"""

from __future__ import annotations

from typing import Annotated, Union

import msgspec

from hearth.config import Role
from hearth.kv_transfer.descriptor import check_descriptor, check_transfer_id
from hearth.engine.kv.transfer_api import KVDescriptor, KVTransfer
from hearth.engine.refusals import RequestRejected


class PrefillHop(msgspec.Struct, tag=Role.PREFILL.value, tag_field="role",
                 forbid_unknown_fields=True):
    transfer_id: str  # lease key, unique per prefill hop (the router makes a UUID)


class DecodeHop(msgspec.Struct, tag=Role.DECODE.value, tag_field="role",
                forbid_unknown_fields=True):
    prompt_token_ids: list[int]  # the prompt exactly as the prefill worker tokenized it
    first_token_id: int  # the token the prefill hop sampled
    descriptor: KVDescriptor  # the prefill hop's `kv_transfer.descriptor`, unchanged
    transfer_id: str = ""  # optional; if given it must equal the descriptor's


# A resume hop's token lists: ids fit the engine's 32-bit token ids (the worker checks its
# vocabulary); the length bound only keeps a hostile list from being decoded at all (the body
# size limit comes first; the worker checks the context length).
MAX_RESUME_TOKEN_IDS = 1 << 20
TokenIds = Annotated[list[Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]],
                     msgspec.Meta(max_length=MAX_RESUME_TOKEN_IDS)]


class ResumeHop(msgspec.Struct, tag="resume", tag_field="role", forbid_unknown_fields=True):
    """Continue a stream another worker began: the output so far counts as generated here."""

    output_token_ids: TokenIds  # the output so far, in order (may be empty: a plain re-run)
    prompt_token_ids: TokenIds | None = None  # the prompt as first tokenized; None: tokenize


class PrefillResult(msgspec.Struct, kw_only=True):
    transfer_id: str
    prompt_token_ids: list[int]  # what the decode hop must send back
    first_token_id: int
    first_token_logprob: float | None = None  # when the request asked for logprobs
    num_prompt_tokens: int
    num_cached_tokens: int  # prefix-cache hits on the prefill worker (usage.cached_tokens)
    descriptor: KVDescriptor  # where the decode worker pulls the KV from


class DecodeResult(msgspec.Struct, kw_only=True):
    num_transferred_tokens: int  # prompt tokens received instead of computed
    num_transferred_blocks: int
    num_transferred_bytes: int


_hop_decoder = Union[PrefillHop, DecodeHop, ResumeHop]


def parse_kv_transfer(obj: object) -> PrefillHop | DecodeHop | ResumeHop:
    """The request's `kv_transfer` value; ValueError (400, param kv_transfer) if malformed."""
    try:
        hop = msgspec.convert(obj, _hop_decoder)
    except msgspec.ValidationError as exc:
        raise RequestRejected("kv_transfer", f"kv_transfer: {exc}") from None
    if isinstance(hop, PrefillHop):
        check_transfer_id(hop.transfer_id)
    elif isinstance(hop, ResumeHop):
        if hop.prompt_token_ids is not None and not hop.prompt_token_ids:
            raise RequestRejected("kv_transfer.prompt_token_ids",
                                  "kv_transfer.prompt_token_ids: must not be empty")
    elif not hop.prompt_token_ids:
        raise RequestRejected(
            "kv_transfer.prompt_token_ids",
            "kv_transfer.prompt_token_ids: must not be empty")
    elif hop.transfer_id and hop.transfer_id != hop.descriptor.transfer_id:
        raise RequestRejected(
            "kv_transfer.transfer_id",
            "kv_transfer.transfer_id: differs from the descriptor's")
    else:
        check_descriptor(hop.descriptor)
    return hop


def to_engine(hop: PrefillHop | DecodeHop) -> KVTransfer:
    """The engine's spec; a decode hop's prompt is `hop.prompt_token_ids` (not re-tokenized)."""
    if isinstance(hop, PrefillHop):
        return KVTransfer(role=Role.PREFILL, transfer_id=hop.transfer_id)
    return KVTransfer(role=Role.DECODE, transfer_id=hop.descriptor.transfer_id,
                      descriptor=hop.descriptor, first_token_id=hop.first_token_id)


def prefill_result(transfer_id: str, prompt_token_ids: list[int], first_token_id: int,
                   first_token_logprob: float | None, num_cached_tokens: int,
                   descriptor: KVDescriptor) -> dict:
    """The prefill hop response's `kv_transfer` value (from the finished RequestOutput)."""
    return msgspec.to_builtins(PrefillResult(
        transfer_id=transfer_id, prompt_token_ids=list(prompt_token_ids),
        first_token_id=first_token_id, first_token_logprob=first_token_logprob,
        num_prompt_tokens=len(prompt_token_ids), num_cached_tokens=num_cached_tokens,
        descriptor=descriptor))


def parse_prefill_result(obj: object) -> PrefillResult:
    """(router) The prefill hop response's `kv_transfer`; ValueError if malformed."""
    try:
        result = msgspec.convert(obj, PrefillResult)
    except msgspec.ValidationError as exc:
        raise ValueError(f"kv_transfer (prefill response): {exc}") from None
    if not result.prompt_token_ids:
        raise ValueError("kv_transfer (prefill response): prompt_token_ids is empty")
    return result


def decode_hop(prefill: PrefillResult) -> DecodeHop:
    """(router) The decode hop's `kv_transfer`, from the prefill hop's result."""
    return DecodeHop(prompt_token_ids=prefill.prompt_token_ids,
                     first_token_id=prefill.first_token_id, descriptor=prefill.descriptor,
                     transfer_id=prefill.transfer_id)


def decode_request_field(prefill: dict | PrefillResult) -> dict:
    """The decode hop's `kv_transfer` value as JSON, from the prefill hop's response field."""
    result = prefill if isinstance(prefill, PrefillResult) else parse_prefill_result(prefill)
    return msgspec.to_builtins(decode_hop(result))


def resume_hop(output_token_ids: list[int], prompt_token_ids: list[int] | None = None) -> dict:
    """(router) A resume hop's `kv_transfer` value: the client's stream so far (its
    `token_ids`, concatenated) and, if known, the prompt ids the first worker reported."""
    return msgspec.to_builtins(ResumeHop(list(output_token_ids),
                                         None if prompt_token_ids is None else list(prompt_token_ids)))


def decode_result(num_transferred_tokens: int, num_transferred_blocks: int,
                  num_transferred_bytes: int) -> dict:
    """The decode hop's final response `kv_transfer` value (from the finished RequestOutput)."""
    return msgspec.to_builtins(DecodeResult(num_transferred_tokens=num_transferred_tokens,
                                            num_transferred_blocks=num_transferred_blocks,
                                            num_transferred_bytes=num_transferred_bytes))

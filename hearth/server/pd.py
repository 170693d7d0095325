"""The `kv_transfer` request field on a prefill or decode worker (see docs/pd_protocol.md).

Contract with the router's stitcher: the client must see exactly what a monolithic worker sends.
  * Prefill hop: the response carries the first token as the monolithic stream would have sent
    it *so far*: text a tool-call parser is still holding (e.g. a `<tool_call>` prefix) is NOT
    flushed at the hop's end, since the output goes on elsewhere.
  * Decode hop: the worker's parser first reads the first token's text and drops what that
    produces (the prefill hop already sent it), so its stream continues exactly where the prefill
    hop's stopped; `completion_tokens` counts the first token once (it is the decode side's).
  * Resume hop (any worker but a prefill one): the given output tokens are this request's
    first output, sent again in full (text, tool-call deltas, logprob placeholders, their ids),
    then sampling goes on; the stitcher skips what the client already has.
"""

from __future__ import annotations

from dataclasses import dataclass

from hearth.api.pd_protocol import (DecodeHop, PrefillHop, ResumeHop, decode_result,
                                       parse_kv_transfer, prefill_result, to_engine)
from hearth.config import Role
from hearth.engine.kv.transfer_api import KVTransfer
from hearth.api.protocol import bad_request
from hearth.server.serving import ChoiceProgress


@dataclass
class Hop:
    """One request's kv_transfer hop, parsed and checked against this worker's role."""

    hop: PrefillHop | DecodeHop | ResumeHop
    spec: KVTransfer | None  # what the engine gets (None: a resume, which needs no connector)

    @property
    def is_prefill(self) -> bool:
        return isinstance(self.hop, PrefillHop)

    @property
    def is_decode(self) -> bool:
        return isinstance(self.hop, DecodeHop)

    @property
    def is_resume(self) -> bool:
        return isinstance(self.hop, ResumeHop)

    @property
    def prompt_token_ids(self) -> list[int] | None:
        """The prompt the hop gives (not re-tokenized), or None: the worker tokenizes."""
        return self.hop.prompt_token_ids if not self.is_prefill else None

    @property
    def output_token_ids(self) -> list[int]:
        """A resume's output so far ([] for the other hops)."""
        return self.hop.output_token_ids if self.is_resume else []


def parse_hop(role: Role, raw: object | None, n: int, vocab_size: int) -> Hop | None:
    """None for an ordinary request; a 400 (param kv_transfer...) for anything malformed."""
    if raw is None:
        return None
    try:
        hop = parse_kv_transfer(raw)
    except ValueError as exc:
        raise bad_request(str(exc), param="kv_transfer") from None
    if isinstance(hop, ResumeHop):
        if role is Role.PREFILL:
            raise bad_request("kv_transfer: a resume hop needs a worker that decodes; this "
                              "worker's role is 'prefill'", param="kv_transfer")
    elif role is Role.BOTH:
        raise bad_request("kv_transfer needs a worker started with --role prefill or decode",
                          param="kv_transfer")
    elif (Role.PREFILL if hop.__class__ is PrefillHop else Role.DECODE) is not role:
        raise bad_request(f"kv_transfer: this worker's role is '{role}'", param="kv_transfer")
    if n != 1:
        raise bad_request("kv_transfer: a disaggregated request has n=1", param="n")
    if isinstance(hop, ResumeHop):  # (the engine checks the output ids: the model's vocabulary)
        if any(t >= vocab_size for t in hop.prompt_token_ids or ()):
            raise bad_request(f"kv_transfer.prompt_token_ids: token id outside the vocabulary "
                              f"[0, {vocab_size})", param="kv_transfer.prompt_token_ids")
        return Hop(hop, None)
    return Hop(hop, to_engine(hop))


def first_token_text(tokenizer, hop: Hop, skip_special_tokens: bool = True) -> str:
    """The decode hop's first token as text (decoded as the request's output is), for seeding
    its tool-call parser."""
    return tokenizer.decode([hop.hop.first_token_id], skip_special_tokens=skip_special_tokens)


def hop_result(hop: Hop, choice: ChoiceProgress, prompt_ids: list[int]) -> dict | None:
    """The response's `kv_transfer` value. Prefill: the descriptor and first token (None when
    no KV was exported: the request failed before its first token). Decode: transfer counts."""
    if hop.is_decode:
        return decode_result(*choice.transferred)
    if choice.kv_descriptor is None or choice.first_token_id is None:
        return None
    return prefill_result(hop.hop.transfer_id, prompt_ids, choice.first_token_id,
                          choice.first_logprob, choice.num_cached_tokens, choice.kv_descriptor)

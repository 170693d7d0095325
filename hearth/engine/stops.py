"""Where an output ends: the one per-token check that every output token goes through.

A step's sampled tokens (`LLMEngine._accept_tokens`) and a resumed stream's given tokens
(`LLMEngine._resume`) are checked by the same function, so a resumed output stops exactly where
the uninterrupted one would have: at the first token that is EOS (unless `ignore_eos`) or a
stop token id, that completes a stop string, that ends the grammar, or that reaches
`max_tokens` or the context length. Each token is pushed to the request's detokenizer and
accepted by its grammar matcher in order; after the last token the grammar may force more
(jump-forward), which are checked the same way and returned apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hearth.engine.text.detokenizer import IncrementalDetokenizer
from hearth.engine.refusals import RequestRejected
from hearth.engine.request import Request, RequestStatus


class GrammarRefused(ValueError):
    """The request's grammar does not allow `token_id` at output position `index` (0-based,
    counted from the first token checked)."""

    def __init__(self, index: int, token_id: int) -> None:
        super().__init__(f"grammar rejected token {token_id}")
        self.index, self.token_id = index, token_id


@dataclass
class Checked:
    kept: list[int] = field(default_factory=list)  # given tokens up to the one that ends it
    forced: list[int] = field(default_factory=list)  # jump-forward tokens after the last kept
    text: str = ""  # what the detokenizer released for them (not flushed)
    status: RequestStatus | None = None  # None: the output goes on

    @property
    def num_checked(self) -> int:
        return len(self.kept) + len(self.forced)


def check_tokens(req: Request, token_ids: list[int], detok: IncrementalDetokenizer,
                 eos_token_ids: tuple[int, ...], max_model_len: int) -> Checked:
    """Check `token_ids`, which would follow `req`'s current tokens, one by one; stop at the
    first that ends the output (sets `req.stop_reason` for a stop token or string). Advances
    the detokenizer and the grammar; appends nothing to `req`. Raises GrammarRefused."""
    p, out = req.params, Checked()
    tokens = list(token_ids)
    for i, token in enumerate(tokens):  # `tokens` grows by the forced tokens (below)
        (out.kept if i < len(token_ids) else out.forced).append(token)
        if token in p.stop_token_ids or (not p.ignore_eos and token in eos_token_ids):
            out.status = RequestStatus.FINISHED_STOPPED
            req.stop_reason = token if token in p.stop_token_ids else None
            break
        out.text += detok.push([token])
        if detok.stopped_by is not None:
            out.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, detok.stopped_by
            break
        if req.grammar is not None:
            if not req.grammar.accept(token):
                raise GrammarRefused(i, token)
            if req.grammar.is_terminated():
                out.status = RequestStatus.FINISHED_STOPPED
                break
            if i == len(tokens) - 1:  # appended without a decode step (guided.py)
                tokens += req.grammar.forced_token_ids()
        if (req.num_output_tokens + out.num_checked >= p.max_tokens
                or req.num_tokens + out.num_checked >= max_model_len):
            out.status = RequestStatus.FINISHED_LENGTH
            break
    return out


RESUME_PARAM = "kv_transfer.output_token_ids"  # the request field a resume's refusals name


def check_resume(output_token_ids: list[int], num_prompt_tokens: int, max_tokens: int,
                 vocab_size: int, max_model_len: int, num_pool_tokens: int) -> None:
    """A resumed output's ids, before anything is built: in the vocabulary, within max_tokens,
    the context length and the KV pool (RequestRejected naming the field). Where the output
    ends is `check_tokens`' business."""
    bad = [t for t in output_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestRejected(RESUME_PARAM, f"{RESUME_PARAM}: token id {bad[0]} outside the "
                              f"vocabulary [0, {vocab_size})")
    num_output = len(output_token_ids)
    total = num_prompt_tokens + num_output
    if total > max_model_len or total + 1 > num_pool_tokens:
        raise RequestRejected(RESUME_PARAM, f"{RESUME_PARAM}: the prompt ({num_prompt_tokens} "
                              f"tokens) and the output so far ({num_output}) exceed the "
                              f"model's context length ({max_model_len}) or the KV cache",
                              "context_length_exceeded")
    if num_output > max_tokens:
        raise RequestRejected(RESUME_PARAM, f"{RESUME_PARAM}: {num_output} tokens, more than "
                              f"max_tokens ({max_tokens})")


def check_resumed(req: Request, token_ids: list[int], detok: IncrementalDetokenizer,
                  eos_token_ids: tuple[int, ...], max_model_len: int) -> Checked:
    """`check_tokens` over a resumed output, all of which must be kept: the grammar refusing
    one, or the output ending before the last, is a RequestRejected."""
    try:
        checked = check_tokens(req, token_ids, detok, eos_token_ids, max_model_len)
    except GrammarRefused as exc:
        raise RequestRejected(RESUME_PARAM, f"{RESUME_PARAM}: token {exc.token_id} at position "
                              f"{exc.index} is not allowed by the request's response format "
                              f"or tool grammar") from None
    if len(checked.kept) < len(token_ids):
        raise RequestRejected(RESUME_PARAM, f"{RESUME_PARAM}: the output ends at position "
                              f"{len(checked.kept) - 1} ({checked.status.value}), but "
                              f"{len(token_ids)} tokens were given")
    return checked

"""The engine's output side: each request's incremental detokenizer, the stop checks over the
tokens a step (or a resume) gives it, and the `RequestOutput` deltas it reports.

`LLMEngine` (engine.py) decides what happens to a request (commit, finish, export, drafts);
this holds what turns its tokens into text and outputs, so that state has one owner: a
detokenizer exists from `open` until the request's finished output is made (or `drop`).
"""

from __future__ import annotations

from hearth.engine.request import Logprob, Request, RequestOutput, ttft_breakdown
from hearth.engine.sampling_params import SamplingParams
from hearth.engine.stops import Checked, check_resumed, check_tokens
from hearth.engine.text.detokenizer import IncrementalDetokenizer


def forced_logprob(token: int) -> Logprob:
    """A jump-forward token's logprob: the grammar allowed nothing else, so under the
    constrained distribution (the one sampled tokens' logprobs come from) its p is 1."""
    return Logprob(token, 0.0, [(token, 0.0)])


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: tuple[int, ...], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self._detok: dict[str, IncrementalDetokenizer] = {}

    def open(self, request_id: str, params: SamplingParams) -> None:
        self._detok[request_id] = IncrementalDetokenizer(
            self.tokenizer, skip_special_tokens=params.skip_special_tokens, stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output)

    def __contains__(self, request_id: str) -> bool:
        """Whether `request_id` has output state (opened, not yet finished or dropped)."""
        return request_id in self._detok

    def drop(self, request_id: str) -> None:
        """A request refused after `open`: nothing of it is reported."""
        self._detok.pop(request_id, None)

    def push_context(self, request_id: str, token_ids: list[int]) -> None:
        """Tokens whose text was reported elsewhere (a decode hop's first token) but that the
        detokenizer needs as context and for stop strings spanning them."""
        self._detok[request_id].push(token_ids)

    def check(self, req: Request, token_ids: list[int]) -> Checked:
        """The tokens a step gave `req`, kept up to the first that ends it, with their text."""
        return check_tokens(req, token_ids, self._detok[req.request_id], self.eos_token_ids,
                            self.max_model_len)

    def check_resumed(self, req: Request, token_ids: list[int]) -> Checked:
        """A resumed stream's given tokens (RequestRejected if they cannot be its output)."""
        return check_resumed(req, token_ids, self._detok[req.request_id], self.eos_token_ids,
                             self.max_model_len)

    def final_text(self, req: Request) -> str:
        """What the detokenizer still holds back, at the end of the request (nothing once a
        stop string ended it: the text after the stop is not output)."""
        detok = self._detok.get(req.request_id)
        if detok is None or detok.stopped_by is not None:
            return ""
        return detok.flush()

    def output(self, req: Request, tokens: list[int], text: str,
               logprobs: list[Logprob] | None = None) -> RequestOutput:
        """The delta to report; a finished request's detokenizer goes with its last output."""
        finished = req.is_finished
        breakdown = None
        if finished:
            self._detok.pop(req.request_id, None)
            breakdown = ttft_breakdown(req)
        return RequestOutput(
            request_id=req.request_id, new_token_ids=tokens, new_text=text, finished=finished,
            finish_reason=req.status.value if finished else None,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=max(0, req.num_cached_tokens),
            num_output_tokens=req.num_output_tokens, new_logprobs=logprobs or [],
            stop_reason=req.stop_reason, error=req.error, kv_descriptor=req.kv_descriptor,
            num_transferred_tokens=req.num_transferred_tokens,
            num_transferred_blocks=req.num_transferred_blocks,
            num_transferred_bytes=req.num_transferred_bytes,
            queue_seconds=(req.first_scheduled_time - req.arrival_time
                           if finished and req.first_scheduled_time is not None else None),
            prompt_chunks_seconds=breakdown[1] if breakdown else None,
            first_step_seconds=breakdown[2] if breakdown else None,
            first_step_tokens=req.first_step_tokens if breakdown else 0,
        )

    def finished_output(self, req: Request) -> RequestOutput:
        """A request ended outside a step's tokens (abort, error, length, refusal)."""
        text = self._detok[req.request_id].flush() if req.request_id in self._detok else ""
        return self.output(req, [], text)

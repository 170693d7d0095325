"""What both endpoints share: the server's state, request fields -> SamplingParams, admission,
and `RequestRun`, the engine requests behind one HTTP request (n choices x prompts).

Resource invariant: every engine request a RequestRun submits ends in one of three ways: its
finished output arrives, `abort_unfinished()` aborts it (client gone, error, cancellation), or
the engine process dies (the client fails it). Handlers call `abort_unfinished()` in `finally`.
"""

from __future__ import annotations

import asyncio
import json
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable

from hearth.config import Role
from hearth.engine.kv.transfer_api import KVDescriptor
from hearth.engine.refusals import RequestRejected
from hearth.engine.request import RequestOutput
from hearth.engine.sampling_params import GuidedSpec, SamplingParams
from hearth.api.edge import CpuPool
from hearth.server.engine_client import EngineClient, EngineDeadError, EngineRejectedError
from hearth.server.worker_metrics import ServerMetrics
from hearth.api.protocol import (APIError, ResponseFormat, StructuredOutputs, bad_request,
                                 model_not_found)
from hearth.api.chat_chunks import TokenTexts, Usage
from hearth.server.server_config import ServerConfig

DISCONNECT_POLL_SECONDS = 0.5
MAX_CHOICES = 16  # n per request (times the prompts of a batched completion)


@dataclass
class ServerState:
    engine: EngineClient
    tokenizer: Any  # hearth.engine.text.tokenizer.Tokenizer, loaded in this process too
    config: ServerConfig
    metrics: ServerMetrics
    model_name: str
    max_model_len: int
    tool_parser: str  # resolved parser name for template-rendered tools
    token_texts: TokenTexts
    cpu: CpuPool  # rendering and tokenizing run here, off the event loop
    max_token_chars: int  # the longest token's text (bounds the characters of a fitting prompt)
    role: Role = Role.BOTH  # which kv_transfer hops it serves (see hearth/server/pd.py)
    aliases: tuple[str, ...] = ()  # more names `model` may give (--served-model-name A B C)
    chat_format: str = "template"  # template | harmony: --chat-format, resolved for the model
    # the reasoning parser every unguided choice gets (--reasoning-parser; the harmony format's
    # own when it is in use); None: all output is content
    reasoning_parser: str | None = None

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every name this worker answers to; `model_name` (the first) is what responses carry."""
        return (self.model_name, *self.aliases)


def check_model(state: ServerState, model: str | None) -> None:
    """`model` must be one of the served names (its aliases included); None means any."""
    if model is not None and model not in state.model_names:
        raise model_not_found(model)


def check_token_ids(state: ServerState, token_ids: Any, param: str) -> None:
    """Every id a client sends (prompt, stop_token_ids, logit_bias keys) is in the vocabulary."""
    vocab_size = state.tokenizer.vocab_size
    if not all(0 <= t < vocab_size for t in token_ids):
        raise bad_request(f"{param}: token id outside the vocabulary [0, {vocab_size})", param=param)


def check_prompt_chars(state: ServerState, text: str, param: str) -> None:
    """Refuse, before tokenizing it, a text too long to fit the context whatever its tokens:
    no token covers more than `max_token_chars` characters (x2 for normalisation), so a longer
    text has more than max_model_len tokens. Keeps tokenizer time and memory bounded."""
    max_chars = 2 * state.max_token_chars * state.max_model_len
    if len(text) > max_chars:
        raise bad_request(
            f"this model's maximum context length is {state.max_model_len} tokens; a text of "
            f"{len(text)} characters cannot fit (at most {max_chars})", param=param,
            code="context_length_exceeded")


def _logit_bias_ids(state: ServerState, logit_bias: dict[str, float] | None) -> None:
    ids = []
    for key in logit_bias or {}:
        if not key.isdigit() or len(key) > 10:
            raise bad_request(f"logit_bias: key {key[:20]!r} is not a token id", param="logit_bias")
        ids.append(int(key))
    check_token_ids(state, ids, "logit_bias")


def wrap_int64(value: int) -> int:
    """A seed plus a choice offset, kept in int64 (the engine's typed messages carry 64 bits)."""
    return (value + 2**63) % 2**64 - 2**63


def check_n(n: int) -> None:
    if not 1 <= n <= MAX_CHOICES:
        raise bad_request(f"n must be between 1 and {MAX_CHOICES}, got {n}", param="n")


def response_format_guidance(response_format: ResponseFormat | None) -> GuidedSpec | None:
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return GuidedSpec("json_object")
    spec = response_format.json_schema
    if spec is None or spec.schema_ is None:
        raise bad_request("response_format.json_schema.schema is required",
                          param="response_format.json_schema")
    return GuidedSpec("json_schema", json.dumps(spec.schema_))


def structured_outputs_guidance(spec: StructuredOutputs) -> GuidedSpec:
    """vLLM's `structured_outputs` extension: exactly one of a regex or a grammar."""
    if (spec.regex is None) == (spec.grammar is None):
        raise bad_request("structured_outputs: give exactly one of regex, grammar",
                          param="structured_outputs")
    if spec.regex is not None:
        return GuidedSpec("regex", spec.regex)
    return GuidedSpec("grammar", spec.grammar or "")


def sampling_params(state: ServerState, request: Any, num_prompt_tokens: int, max_tokens: int | None,
                    logprobs: int | None, guided: GuidedSpec | None, seed_offset: int = 0) -> SamplingParams:
    """Map request fields onto SamplingParams; out-of-range values are 400s naming the field."""
    room = state.max_model_len - num_prompt_tokens
    if room <= 0 or (max_tokens is not None and max_tokens > room):
        asked = max_tokens if max_tokens is not None else 1
        raise bad_request(
            f"this model's maximum context length is {state.max_model_len} tokens; the prompt has "
            f"{num_prompt_tokens} tokens and {asked} more were requested for the output",
            param="max_tokens" if max_tokens is not None and room > 0 else "messages",
            code="context_length_exceeded")
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    check_token_ids(state, request.stop_token_ids or (), "stop_token_ids")
    _logit_bias_ids(state, request.logit_bias)
    try:
        return SamplingParams(
            max_tokens=max_tokens if max_tokens is not None else room,
            temperature=1.0 if request.temperature is None else request.temperature,
            top_p=1.0 if request.top_p is None else request.top_p,
            top_k=request.top_k or 0,
            min_p=request.min_p or 0.0,
            seed=None if request.seed is None else wrap_int64(request.seed + seed_offset),
            presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty,
            repetition_penalty=1.0 if request.repetition_penalty is None else request.repetition_penalty,
            stop=tuple(stop),
            stop_token_ids=tuple(request.stop_token_ids or ()),
            ignore_eos=request.ignore_eos,
            logprobs=logprobs,
            include_stop_str_in_output=request.include_stop_str_in_output,
            skip_special_tokens=request.skip_special_tokens,
            guided=guided,
        )
    except RequestRejected as exc:
        raise bad_request(str(exc), param=exc.param, code=exc.code) from None


@dataclass
class ChoiceProgress:
    """Timing and counts of one engine request, for usage and metrics."""

    arrival: float
    first_token_at: float | None = None
    last_token_at: float | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    first_token_id: int | None = None
    first_logprob: float | None = None
    kv_descriptor: KVDescriptor | None = None  # prefill hop: the exported lease
    transferred: tuple[int, int, int] = (0, 0, 0)  # decode hop: (tokens, blocks, bytes)
    stop_string: str | None = None  # the stop string that ended the output, if one did


@dataclass
class RequestRun:
    state: ServerState
    response_id: str
    is_disconnected: Callable[[], Awaitable[bool]] | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    choices: list[ChoiceProgress] = field(default_factory=list)
    _index_of: dict[str, int] = field(default_factory=dict)
    _queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    _num_unfinished: int = 0
    _last_disconnect_check: float = field(default_factory=time.monotonic)

    def admit(self, num_new: int) -> None:
        """Refuse (429) when the queue of not-yet-running requests is full: bounded memory."""
        engine = self.state.engine
        if not engine.is_ready:
            raise APIError(503, engine.failure or "the model is still loading", "service_unavailable",
                           code="not_ready")
        queued = max(0, engine.num_requests - engine.stats.num_running)
        if queued + num_new > self.state.config.max_waiting:
            self.state.metrics.observe_rejected("queue_full")
            raise APIError(429, f"server is at capacity ({queued} requests waiting); retry later",
                           "rate_limit_exceeded", code="queue_full")

    async def submit(self, prompts: list[list[int]], params: list[SamplingParams],
                     kv_transfer=None, num_output_tokens: int = 0,
                     output_token_ids: list[int] = ()) -> None:
        """Add one engine request per (prompt, params), all in one burst so they can share an
        engine step; all or nothing (on any refusal, or cancellation, the others are aborted).
        `output_token_ids`: a resume hop's output so far (the engine reports it as output)."""
        self.admit(len(prompts))
        accepted = []  # registered and sent before any await: admission sees them at once
        try:
            for index, (prompt_ids, choice_params) in enumerate(zip(prompts, params)):
                request_id = f"{self.response_id}-{index}"
                self._index_of[request_id] = index
                # (a decode hop's first token was sampled by the prefill worker but is its output)
                self.choices.append(ChoiceProgress(arrival=time.monotonic(),
                                                   num_prompt_tokens=len(prompt_ids),
                                                   num_output_tokens=num_output_tokens))
                accepted.append(self.state.engine.add_nowait(request_id, prompt_ids, choice_params,
                                                             self._queue, kv_transfer,
                                                             output_token_ids))
            results = await asyncio.gather(*accepted, return_exceptions=True)
        except BaseException as exc:  # no path leaves an engine request registered
            self.abort_unfinished()
            if isinstance(exc, EngineDeadError):
                raise _as_api_error(exc) from None
            raise
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            self.abort_unfinished()
            raise _as_api_error(errors[0]) from None
        self._num_unfinished = len(results)

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, output) until every choice has finished."""
        while self._num_unfinished:
            output = await self._next_output()
            index = self._index_of.get(output.request_id)
            if index is None:
                continue
            self._track(index, output)
            yield index, output

    async def _next_output(self) -> RequestOutput:
        """The next output; without a stream to write to, the client's departure is only seen
        by asking, so ask every DISCONNECT_POLL_SECONDS whether outputs flow or not."""
        if self.is_disconnected is None:
            return await self._queue.get()
        while True:
            now = time.monotonic()
            if now - self._last_disconnect_check >= DISCONNECT_POLL_SECONDS:
                self._last_disconnect_check = now
                if await self.is_disconnected():
                    raise ClientGone()
            try:
                return await asyncio.wait_for(self._queue.get(), DISCONNECT_POLL_SECONDS)
            except asyncio.TimeoutError:
                continue

    def _track(self, index: int, output: RequestOutput) -> None:
        choice, now = self.choices[index], time.monotonic()
        metrics = self.state.metrics
        choice.num_prompt_tokens = output.num_prompt_tokens or choice.num_prompt_tokens
        num_new = len(output.new_token_ids)
        if num_new and choice.first_token_id is None:
            choice.first_token_id = output.new_token_ids[0]
            if output.new_logprobs:
                choice.first_logprob = output.new_logprobs[0].logprob
        if output.kv_descriptor is not None:
            choice.kv_descriptor = output.kv_descriptor
        if output.num_transferred_tokens:
            choice.transferred = (output.num_transferred_tokens, output.num_transferred_blocks,
                                  output.num_transferred_bytes)
        if num_new and choice.first_token_at is None:
            choice.first_token_at = now
            choice.num_cached_tokens = output.num_cached_tokens
            metrics.observe_first_token(now - choice.arrival, choice.num_prompt_tokens,
                                        output.num_cached_tokens)
            metrics.observe_tokens(num_new, None)
        elif num_new:
            metrics.observe_tokens(num_new, now - (choice.last_token_at or now))
        if num_new:
            choice.last_token_at = now
        choice.num_output_tokens += num_new
        if output.finished:
            self._num_unfinished -= 1
            # a resume's first output came before it was scheduled: the hits are known now
            choice.num_cached_tokens = max(choice.num_cached_tokens, output.num_cached_tokens)
            choice.finish_reason, choice.error = output.finish_reason, output.error
            choice.stop_string = stop_string(output)
            metrics.observe_finish(output.finish_reason or "stop", now - choice.arrival,
                                   choice.num_prompt_tokens, choice.num_output_tokens,
                                   output.queue_seconds)
            if choice.first_token_at is not None:
                metrics.observe_ttft_breakdown(choice.first_token_at - choice.arrival, output)
            metrics.set_engine_stats(self.state.engine.stats)

    def abort_unfinished(self) -> None:
        unfinished = [rid for rid, idx in self._index_of.items() if self.choices[idx].finish_reason is None]
        self.state.engine.abort(unfinished)
        for request_id in unfinished:
            self.state.engine.forget(request_id)

    def usage(self, prompt_choices: list[int] | None = None) -> Usage:
        """Prompt tokens count once per distinct prompt (choice indexes in `prompt_choices`)."""
        firsts = prompt_choices if prompt_choices is not None else [0]
        return Usage(
            prompt_tokens=sum(self.choices[i].num_prompt_tokens for i in firsts),
            completion_tokens=sum(c.num_output_tokens for c in self.choices),
            cached_tokens=sum(self.choices[i].num_cached_tokens for i in firsts),
        )


def stop_string(output: RequestOutput) -> str | None:
    """The stop string that ended a finished output (None: EOS, a stop token id, or length)."""
    return output.stop_reason if isinstance(output.stop_reason, str) else None


def abort_when_dropped(stream: AsyncIterator[str], run: RequestRun) -> AsyncIterator[str]:
    """A stream dropped before its first iteration (client gone before the response started)
    never runs its `finally`; abort its requests when it is collected, too."""
    weakref.finalize(stream, run.abort_unfinished)
    return stream


class ClientGone(Exception):
    """The HTTP client disconnected; the run's requests are aborted by the handler."""


def _as_api_error(exc: BaseException) -> BaseException:
    if isinstance(exc, EngineRejectedError):
        r = exc.rejection
        return bad_request(r.message, param=r.param, code=r.code)
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), "service_unavailable", code="engine_unavailable")
    return exc


def raise_if_failed(choice: ChoiceProgress) -> None:
    if choice.finish_reason == "error":
        raise APIError(500, choice.error or "the engine failed this request", "internal_server_error")

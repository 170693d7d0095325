"""PD orchestration: route a request, run the prefill hop, then the decode hop, as one response.

    choose (policy) -> [prefill hop: max_tokens=1 + transfer id] -> decode hop (stream) -> stitch

Failure handling, in the order a request can meet it:
  * prefill hop fails (endpoint down, 5xx, at capacity): retried on the next-cheapest prefill
    endpoint; when none is left the decode endpoint prefills the prompt itself. Nothing has
    reached the client yet, so every retry is invisible.
  * decode hop fails before it sent anything: the same `kv_transfer` goes to another decode
    endpoint (if the lease is gone meanwhile, that worker recomputes the prompt: still correct).
  * decode hop fails mid-stream: a greedy request is re-run on another endpoint and the
    stitcher skips what the client already has, so the stream simply continues; a sampled one
    ends with an OpenAI error event and [DONE]. The client never hangs: every hop has a
    connect timeout and an idle timeout.
  * a worker's 4xx about the request itself goes back to the client unchanged.
Every path closes the request's `Ticket`, so load predictions never leak.
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable, TypeVar

import httpx

from hearth.config import Role
from hearth.engine.kv.block_hash import hash_blocks
from hearth.router.endpoints import EndpointPool, SessionTable, Ticket
from hearth.router.health import ModelInfo
from hearth.router.hops import HopError, Stream, WorkerRejected, open_stream, post_json
from hearth.router.router_metrics import RouterMetrics
from hearth.router.pd_fields import (PrefillDone, decode_body, finish_chunk, prefill_body,
                                     resume_body)
from hearth.router.policy import Decision, NoEndpointError, RequestView, choose, choose_prefill
from hearth.router.router_config import RouterConfig
from hearth.router.stitch import Stitcher
from hearth.api.protocol import bad_request

log = logging.getLogger("hearth.router")
T = TypeVar("T")


@dataclass
class Job:
    """One client request as the orchestrator carries it through its hops."""

    chat: bool
    raw: dict  # the client's body, forwarded with only the hop fields changed
    headers: dict[str, str]  # what every hop sends (worker key, session hint)
    model: str
    prompt_ids: list[int] | None  # None: unknown (a batch of prompts), routed without cache view
    session_key: str | None
    can_disaggregate: bool  # n == 1, one prompt, no echo, room for 2+ tokens
    deterministic: bool  # greedy: a re-run reproduces the output, so a stream can continue
    # One output (n == 1, one prompt, no echo): a stream can continue on another worker from
    # the output ids it has (the resume hop), sampled or grammar-constrained alike.
    resumable: bool = False
    kv_reused: bool = False  # a failed decode hop's KV descriptor was tried on another endpoint
    arrival: float = field(default_factory=time.monotonic)
    tried: set[str] = field(default_factory=set)  # endpoints that failed this request
    num_retries: int = 0

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"

    @property
    def stream(self) -> bool:
        return bool(self.raw.get("stream"))

    @property
    def include_usage(self) -> bool:
        return bool((self.raw.get("stream_options") or {}).get("include_usage"))


class Orchestrator:
    def __init__(self, config: RouterConfig, pool: EndpointPool, sessions: SessionTable,
                 metrics: RouterMetrics, client: httpx.AsyncClient, model: ModelInfo) -> None:
        self.config, self.pool, self.sessions = config, pool, sessions
        self.metrics, self.client, self.model = metrics, client, model
        self._sequence = 0  # arrival numbers for round robin

    # ---- routing ------------------------------------------------------------------------------
    def _choose(self, job: Job, can_disaggregate: bool | None = None) -> Decision:
        ids = job.prompt_ids or []
        self._sequence += 1
        view = RequestView(
            num_prompt_tokens=len(ids),
            block_hashes=hash_blocks(ids, self.config.policy.block_size),
            affinity=self.sessions.get(job.session_key),
            can_disaggregate=job.can_disaggregate if can_disaggregate is None else can_disaggregate,
            sequence=self._sequence)
        return choose(view, self.pool.views(job.tried), self.config.policy)

    def _begin(self, job: Job, decision: Decision) -> Ticket:
        ids = job.prompt_ids or []
        self.metrics.decisions.labels(decision.reason).inc()
        self.metrics.requests.labels("pd" if decision.prefill else "local").inc()
        return self.pool.begin(decision, len(ids), hash_blocks(ids, self.config.policy.block_size))

    def _failed(self, job: Job, error: HopError, hop: str) -> None:
        """Record a failed hop: on its endpoint (ejected unless only busy) and on the job (not
        tried again for this request)."""
        log.warning("%s hop failed: %s", hop, error)
        job.tried.add(error.endpoint)
        endpoint = self.pool.get(error.endpoint)
        if endpoint is None:  # discovery removed it meanwhile (its worker is gone)
            return
        if error.eject:
            endpoint.mark_failed(str(error), self.config.health.eject_seconds)
        else:
            endpoint.counters.failures += 1
        endpoint.counters.retries += 1

    def _may_retry(self, job: Job, hop: str) -> bool:
        """Whether the job has a retry left (one more is then counted)."""
        if job.num_retries >= self.config.health.max_retries:
            return False
        job.num_retries += 1
        self.metrics.retries.labels(hop).inc()
        return True

    # ---- entry point --------------------------------------------------------------------------
    async def run(self, job: Job) -> "dict | ResponseStream":
        """The response body, or an iterator of SSE strings. Raises WorkerRejected (the worker's
        4xx), NoEndpointError or HopError (503) before anything was sent."""
        decision = self._choose(job)
        ticket = self._begin(job, decision)
        opened = prefill = None
        try:
            if decision.prefill is None and not job.stream:
                return await self._proxy(job, decision, ticket)
            if decision.prefill is None:
                # Without a prefill hop nothing is sent before the decode worker answers, so
                # its 4xx can still be the client's status.
                opened = await self._open_local(job, ticket)
            else:
                if job.prompt_ids is not None:  # before the hop: a refusal leaves no lease
                    self._check_room(job, len(job.prompt_ids))
                prefill = await self._prefill(job, decision, ticket)
                if prefill is not None:
                    self._check_room(job, prefill.first.num_prompt_tokens)
                else:
                    opened = await self._open_local(job, ticket)
        except BaseException:
            ticket.close()
            raise
        model = prefill.body.get("model", job.model) if prefill else job.model
        stitcher = Stitcher(_new_id(job.chat), int(time.time()), model, job.chat, job.include_usage,
                            pass_token_ids=bool(job.raw.get("return_token_ids")))
        chunks = ResponseStream(self._respond(job, ticket, stitcher, prefill, opened), ticket)
        if job.stream:
            return chunks
        try:
            async for _ in chunks:
                pass  # a non-streamed response is the stitched stream, folded
        finally:
            await chunks.aclose()
        return stitcher.body()

    def _check_room(self, job: Job, num_prompt: int) -> None:
        """The prefill hop runs with max_tokens=1, so the client's max_tokens is checked against
        the context here: before the hop on the router's tokenization (so a refused request
        holds no KV lease on the prefill worker), and again on the prefill worker's count; a
        decode worker's 400 would arrive after the first byte."""
        max_tokens = job.raw.get("max_completion_tokens") or job.raw.get("max_tokens")
        limit = self.model.max_model_len
        if isinstance(max_tokens, int) and limit and max_tokens > limit - num_prompt:
            raise WorkerRejected(400, bad_request(
                f"this model's maximum context length is {limit} tokens; the prompt has "
                f"{num_prompt} tokens and {max_tokens} more were requested for the output",
                param="max_tokens", code="context_length_exceeded").body())

    async def _on_decode_endpoints(self, job: Job, ticket: Ticket, endpoint: str,
                                   attempt: Callable[[str], Awaitable[T]]) -> tuple[str, T]:
        """(endpoint, result) of `attempt(endpoint)` for a hop that nothing was sent of yet and
        that needs no prefill hop: on failure it moves to the next decode endpoint while the
        job has retries left (the ticket moves with it), else the last HopError is raised."""
        while True:
            try:
                return endpoint, await attempt(endpoint)
            except HopError as error:
                self._failed(job, error, "decode")
                if not self._may_retry(job, "decode"):
                    raise
                endpoint = self._choose(job, can_disaggregate=False).decode
                ticket.move_decode(self.pool[endpoint])

    async def _open_local(self, job: Job, ticket: Ticket) -> Stream:
        """The decode stream of a request without a prefill hop, retried on other endpoints."""
        body = decode_body(job.raw, None, token_ids=job.resumable)

        def attempt(endpoint: str) -> Awaitable[Stream]:
            return open_stream(self.client, endpoint, job.path, body, job.headers,
                               self.config.timeouts)

        _, stream = await self._on_decode_endpoints(job, ticket, ticket.decode.url, attempt)
        return stream

    async def _proxy(self, job: Job, decision: Decision, ticket: Ticket) -> dict:
        """A non-streamed request without a prefill hop: forwarded whole, retried whole."""
        def attempt(endpoint: str) -> Awaitable[dict]:
            return post_json(self.client, endpoint, job.path, job.raw, job.headers,
                             self.config.timeouts)

        try:
            endpoint, body = await self._on_decode_endpoints(job, ticket, decision.decode, attempt)
            self._observe_cached(endpoint, body.get("usage"))
            self.sessions.put(job.session_key, (None, endpoint))
            body.pop("kv_transfer", None)
            return body
        finally:
            ticket.close()

    # ---- prefill hop --------------------------------------------------------------------------
    async def _prefill(self, job: Job, decision: Decision, ticket: Ticket) -> PrefillDone | None:
        """The first token and the decode hop's kv_transfer; None when the decode endpoint
        has to prefill itself (every prefill endpoint failed)."""
        endpoint = decision.prefill
        while endpoint is not None:
            try:
                body = await post_json(self.client, endpoint, job.path, prefill_body(job.raw, job.resumable),
                                       job.headers, self.config.timeouts)
                done = PrefillDone.from_response(endpoint, body, job.chat)
            except HopError as error:
                self._failed(job, error, "prefill")
                endpoint, cached = None, 0
                if self._may_retry(job, "prefill"):
                    endpoint, cached = self._next_prefill(job)
                ticket.move_prefill(self.pool[endpoint] if endpoint else None,
                                    len(job.prompt_ids or ()) - cached)
                continue
            self.metrics.ttft.observe(time.monotonic() - job.arrival)
            self._observe_cached(endpoint, body.get("usage"))
            ticket.first_token()
            return done
        log.warning("no prefill endpoint left; %s prefills the prompt itself", ticket.decode.url)
        return None

    def _next_prefill(self, job: Job) -> tuple[str | None, int]:
        ids = job.prompt_ids or []
        view = RequestView(len(ids), hash_blocks(ids, self.config.policy.block_size))
        found = choose_prefill(view, self.pool.views(job.tried), self.config.policy)
        return found if found is not None else (None, 0)

    # ---- decode hop and stitching -------------------------------------------------------------
    async def _respond(self, job: Job, ticket: Ticket, stitcher: Stitcher,
                       prefill: PrefillDone | None, opened: Stream | None) -> AsyncIterator[str]:
        try:
            if prefill is not None:
                for chunk in stitcher.prefill_chunks(prefill.first):
                    yield chunk
                if prefill.finished:  # the first token ended the output: nothing to decode
                    for chunk in stitcher.decode_event(finish_chunk(job.chat, prefill)):
                        yield chunk
                    stitcher.decode_usage = {"completion_tokens": 1}
                    for chunk in stitcher.done_chunks():
                        yield chunk
                    return
            async for chunk in self._decode(job, ticket, stitcher, prefill, opened):
                yield chunk
        finally:
            if opened is not None:
                await opened.close()  # when the client left before the stream was read
            ticket.close()

    async def _decode(self, job: Job, ticket: Ticket, stitcher: Stitcher,
                      prefill: PrefillDone | None, opened: Stream | None) -> AsyncIterator[str]:
        endpoint = ticket.decode.url
        body = decode_body(job.raw, prefill.kv_transfer if prefill else None, job.resumable)
        sent_from_decode = False  # once true, only a re-run from scratch can take over
        while True:
            try:
                async for chunk in self._decode_once(job, ticket, stitcher, endpoint, body, opened):
                    sent_from_decode = True
                    yield chunk
                self.sessions.put(job.session_key, (prefill.endpoint if prefill else None, endpoint))
                self._observe_cached(endpoint, stitcher.decode_usage)
                for chunk in stitcher.done_chunks():
                    yield chunk
                return
            except HopError as error:
                opened = None
                self._failed(job, error, "decode")
                replacement = self._replacement(job, stitcher, prefill, sent_from_decode)
                if replacement is None and not job.stream:
                    raise  # nothing was sent: the client gets a 503, not a partial body
                if replacement is None:
                    self.metrics.stream_errors.inc()
                    for chunk in stitcher.error_chunks(f"the decode endpoint failed: {error}",
                                                       code="decode_failed"):
                        yield chunk
                    return
                endpoint, body = replacement
                ticket.move_decode(self.pool[endpoint])

    async def _decode_once(self, job: Job, ticket: Ticket, stitcher: Stitcher, endpoint: str,
                           body: dict, stream: Stream | None) -> AsyncIterator[str]:
        if stream is None:
            try:
                stream = await open_stream(self.client, endpoint, job.path, body, job.headers,
                                           self.config.timeouts)
            except WorkerRejected as rejected:  # after the first byte the status cannot change
                message = rejected.body["error"].get("message", "rejected")
                raise HopError(endpoint, f"decode hop rejected: {message}", eject=False) from None
        try:
            async for event in stream.events():
                if ticket.prefill is None and not ticket.closed:
                    self._first_local_token(job, ticket)
                for chunk in stitcher.decode_event(event):
                    yield chunk
        finally:
            await stream.close()

    def _first_local_token(self, job: Job, ticket: Ticket) -> None:
        if not ticket.has_first_token:
            self.metrics.ttft.observe(time.monotonic() - job.arrival)
        ticket.first_token()

    def _replacement(self, job: Job, stitcher: Stitcher, prefill: PrefillDone | None,
                     sent_from_decode: bool) -> tuple[str, dict] | None:
        """(endpoint, body) to take over a failed decode, or None (end with an error event)."""
        if not self._may_retry(job, "decode"):
            return None
        if not job.stream:
            sent_from_decode = False  # nothing reached the client: any retry is invisible
            stitcher.reset(keep_first=True)
        try:
            if prefill is not None and not sent_from_decode and not job.kv_reused:
                # The same KV descriptor on another decode endpoint: the output continues
                # after the first token exactly as it would have (sampled or not). Once: if
                # that fails too (the prefill worker went with its node), resume instead.
                decision = self._choose(job)
                if self.pool[decision.decode].role is Role.DECODE:
                    job.kv_reused = True
                    return decision.decode, decode_body(job.raw, prefill.kv_transfer,
                                                        job.resumable)
            resume_ids = stitcher.output_token_ids() if job.resumable else None
            if (job.stream and stitcher.has_output() and not job.deterministic
                    and resume_ids is None):
                return None  # a sampled re-run would not reproduce what the client already has
            decision = self._choose(job, can_disaggregate=False)
        except NoEndpointError:
            return None
        if job.stream and resume_ids:
            # Continue from the ids the client's stream carried: the new worker replays them
            # (grammar included) and samples on; the stitcher skips what was sent.
            stitcher.resume()
            self.metrics.continuations.inc()
            return decision.decode, resume_body(job.raw, resume_ids, stitcher.prompt_token_ids)
        if not job.stream:
            stitcher.reset(keep_first=False)  # the re-run's whole output is the answer
        elif stitcher.has_output():
            stitcher.resume()  # the re-run starts from the first output token: skip what was sent
            self.metrics.continuations.inc()
        return decision.decode, decode_body(job.raw, None, job.resumable)

    def _observe_cached(self, endpoint: str, usage: dict | None) -> None:
        """What the endpoint reported cached, against the policy's prediction (metrics); a
        decode hop's usage counts its local prefix hits."""
        if usage:
            details = usage.get("prompt_tokens_details") or {}
            found = self.pool.get(endpoint)
            if found is not None:
                found.counters.reported_cached_tokens += int(details.get("cached_tokens", 0))


class ResponseStream:
    """A streamed response's SSE strings; `aclose()` also releases the request's ticket, even
    when the client left before the first chunk was pulled (the generator never started)."""

    def __init__(self, chunks: AsyncIterator[str], ticket: Ticket) -> None:
        self._chunks, self._ticket = chunks, ticket

    def __aiter__(self) -> AsyncIterator[str]:
        return self._chunks

    async def aclose(self) -> None:
        try:
            await self._chunks.aclose()
        finally:
            self._ticket.close()


def _new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)

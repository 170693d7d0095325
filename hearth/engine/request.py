"""A request is counters and ids; tensors live in the runner.

Token accounting (the invariant the scheduler keeps):

    all_token_ids = prompt_token_ids + output_token_ids
    num_computed_tokens <= num_tokens            (KV exists for the first num_computed_tokens)
    len(block_ids) * block_size >= num_computed_tokens + tokens granted this step
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from hearth.engine.kv.transfer_api import KVDescriptor, KVTransfer
from hearth.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    WAITING_FOR_KV = "waiting_for_kv"  # decode side: blocks allocated, a transfer is filling them
    WAITING_FOR_GRAMMAR = "waiting_for_grammar"  # not in the scheduler: its grammar compiles
    FINISHED_STOPPED = "stop"  # EOS, stop token or stop string
    FINISHED_LENGTH = "length"  # max_tokens or the context length
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self in _FINISHED


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_ERROR,
}


@dataclass
class Logprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token_id, logprob), best first


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        eos_token_ids: tuple[int, ...] = (),
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.output_logprobs: list[Logprob] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prompt tokens found in the prefix cache at first schedule
        self.num_transferred_tokens = 0  # prompt tokens received from a remote prefill (PD)
        self.num_transferred_blocks = 0
        self.num_transferred_bytes = 0
        self.kv_transfer: KVTransfer | None = None  # the hop of a PD request, else None
        self.kv_import = None  # decode: the connector's handle until the import is done
        self.kv_descriptor: KVDescriptor | None = None  # prefill: the exported lease's
        self.block_ids: list[int] = []
        self.block_hashes: list[int] = []  # chained hashes of the full blocks of all_token_ids
        self.num_registered_blocks = 0  # leading blocks already entered in the prefix cache
        self.spec_token_ids: list[int] = []  # draft tokens proposed for the next step
        self.status = RequestStatus.WAITING
        self.num_preemptions = 0
        self.num_bypassed = 0  # times a request behind it in the queue was admitted first
        self.warm_turn = False  # admitted as a session's next turn (step_policy.is_warm)
        self.arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        # the step that sampled its first token: when it started, and its tokens (all requests')
        self.first_step_start: float | None = None
        self.first_step_tokens = 0
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        # The guided decoder's matcher (a seeded request's generator lives in the RowSampler).
        self.grammar = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, prompt={self.num_prompt_tokens}, "
            f"out={self.num_output_tokens}, computed={self.num_computed_tokens}, "
            f"status={self.status.value})"
        )


@dataclass
class RequestOutput:
    """What the engine reports for one request after a step (deltas since the last report)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    new_logprobs: list[Logprob] = field(default_factory=list)
    stop_reason: int | str | None = None
    error: str | None = None
    kv_descriptor: KVDescriptor | None = None  # prefill hop: where the decode side pulls the KV
    num_transferred_tokens: int = 0  # decode hop: prompt tokens received instead of computed
    num_transferred_blocks: int = 0
    num_transferred_bytes: int = 0
    # At finish, where its time to first token went in the engine: the queue time of any
    # request that was scheduled, the other three only where it got a first token here (a
    # decode hop's chunk time includes its KV import). Queue, chunks and first step add up to
    # arrival -> first token; the server's TTFT adds what came before the engine queued it
    # (HTTP, tokenizing, the step in flight when it came) and the way back.
    queue_seconds: float | None = None  # arrival -> first scheduled (queue time)
    prompt_chunks_seconds: float | None = None  # first scheduled -> the first-token step starts
    first_step_seconds: float | None = None  # that step: its last prompt chunk, first sample
    first_step_tokens: int = 0  # tokens that step computed, every request's


def ttft_breakdown(req: Request) -> tuple[float, float, float] | None:
    """(queue, prompt chunks, first step) seconds of a request that got its first token here:
    arrival -> first scheduled -> start of the step that sampled its first token -> that token.
    A request first scheduled in that very step has no chunk time (the scheduler stamps its
    admission just after the engine stamps the step's start)."""
    if req.first_token_time is None or req.first_scheduled_time is None:
        return None
    step_start = max(req.first_step_start or req.first_scheduled_time, req.first_scheduled_time)
    return (req.first_scheduled_time - req.arrival_time, step_start - req.first_scheduled_time,
            req.first_token_time - step_start)

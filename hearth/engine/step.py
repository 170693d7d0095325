"""The step contract between the engine and its executor: one type for both executors.

    Scheduler.schedule() -> SchedulerOutput            (live Requests, tokens granted, drafts)
    StepBuilder.build(SchedulerOutput) -> StepCommand  (plain data: ids, lengths, each request's
                                                        slot and its table's new blocks, sample
                                                        rows; msgpack-able for T x P ranks)
    executor.execute(StepCommand) -> SampleResult      (ModelRunner in-process, or the rank set;
                                                        StepReceiver rebuilds the whole tables)
    to_step_tokens(SampleResult, requests) -> [StepTokens]
    LLMEngine applies them (the one place results reach requests: `LLMEngine._apply_step`,
    which advances the computed counts through `Scheduler.commit`)

A request granted `num_new` of its own tokens plus draft tokens `d_0..d_{k-1}` (speculative
decoding) computes positions [start, start + num_new + k): its input ids are its uncomputed
tokens followed by the drafts, and its KV is written for all of them. If it samples (its own
tokens then reach `num_tokens`), its SampleRow covers the last 1 + k rows: row j is the model's
distribution after d_0..d_{j-1}. The sampler samples a token t_j at every row and accepts the
longest prefix of drafts with d_j == t_j; the tokens returned are d_0..d_{a-1}, t_a. With a
deterministic draft (n-gram, suffix, a greedy draft model) this is exactly the
rejection-sampling rule: d_j is kept with probability p_j(d_j), and on rejection t_j is a draw
from p_j with d_j removed. Rejected drafts' KV slots are simply overwritten later: the request's
computed count only covers accepted tokens, so the prefix cache never registers their blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import msgspec
import numpy as np
import torch

from hearth.engine.kv.cache import cdiv
from hearth.engine.request import Logprob, Request
from hearth.engine.step_state import SentSlots, StepPlan, table_checksum_term


class SampleRow(msgspec.Struct, frozen=True, array_like=True):
    """What the sampler needs to sample one request: the fields `make_sampling_batch` reads,
    the history a penalty reads, the grammar masks and the draft tokens to verify. On the wire
    a msgpack array (field names would be most of a decode step's bytes)."""

    index: int  # position of the request in StepCommand's request lists
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logprobs: int | None
    seed: int | None
    output_pos: int = 0  # output tokens before the first sampled position (keys seeded draws)
    # The token history a penalty reads (else both empty). On the wire: with output_start 0 the
    # whole history (the slot's executor holds none), else only the output tokens after the
    # first output_start, which the executor holds (hearth/engine/step_state.py). What the
    # sampler gets from `StepReceiver` is always whole (output_start 0).
    prompt_ids: list[int] = []
    output_ids: list[int] = []
    output_start: int = 0
    draft_token_ids: list[int] = []  # the request's last len(drafts) input ids, to verify
    # guided decoding: per sampled position (1 + len(drafts) of them), np.packbits of the
    # allowed-token mask [vocab]; empty when unguided
    allowed: list[bytes] = []

    @property
    def penalised(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1

    @property
    def num_positions(self) -> int:
        return 1 + len(self.draft_token_ids)


class StepCommand(msgspec.Struct, frozen=True, array_like=True):
    """One engine step. Request i computes tokens [context_lens[i] - query_lens[i],
    context_lens[i]); its KV goes to the first cdiv(context_lens[i], block_size) blocks of the
    table of its slot (identical on every rank). A command carries only what changed since the
    slot last ran; `StepReceiver` (hearth/engine/step_state.py) keeps the tables and rebuilds
    them, and every executor applies every command, in order, before computing anything."""

    input_ids: list[int]  # [sum(query_lens)], requests back to back (drafts last in each)
    query_lens: list[int]
    context_lens: list[int]
    slots: list[int]  # each request's slot: a small id it keeps while it runs
    # blocks of the slot's table the executor already holds (a length check); 0: the slot is
    # new or reset (new, resumed after preemption, table changed) and new_block_ids is whole
    num_known_blocks: list[int]
    new_block_ids: list[list[int]]  # blocks appended to the slot's table (mostly [])
    table_checksum: int  # `table_checksum` of the tables the step reads, to catch a divergence
    micro_batch_sizes: list[int]  # requests per micro-batch, in order; sums to len(query_lens)
    samples: list[SampleRow]  # requests that sample this step, by index
    freed_slots: list[int] = []  # requests that stopped running: dropped before anything else

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


class RowOutput(msgspec.Struct, frozen=True):
    """The tokens one SampleRow produced: accepted drafts, then one sampled token."""

    token_ids: list[int]
    logprobs: list[float] = []  # of each token, when the row asked for logprobs
    top_ids: list[list[int]] = []  # [token][k] when the row asked for k > 0
    top_logprobs: list[list[float]] = []


class SampleResult(msgspec.Struct, frozen=True):
    """The outputs of some SampleRows (one micro-batch's, or a whole step's), in their order."""

    rows: list[RowOutput]
    error: str | None = None  # sampling failed (bad parameters): the step fails, ranks stay up


@dataclass
class StepTokens:
    """What one sampling request got from a step."""

    request: Request
    token_ids: list[int]  # accepted drafts, then the sampled token
    logprobs: list[Logprob]  # one per token when the request asked for logprobs, else []
    num_drafted: int  # draft tokens verified this step


def sample_row_positions(cmd: StepCommand) -> list[int]:
    """The input-id index of every sampled position of every sample row, in row order."""
    ends, total = [], 0
    for q in cmd.query_lens:
        total += q
        ends.append(total)
    rows = []
    for row in cmd.samples:
        end = ends[row.index]
        rows.extend(range(end - row.num_positions, end))
    return rows


def make_sample_row(req: Request, index: int, vocab_size: int, drafts: list[int] = (),
                    plan: StepPlan | None = None) -> SampleRow:
    """`plan`: the command's slot changes, to send only the history the executor lacks (None:
    the whole history)."""
    p = req.params
    allowed = _grammar_masks(req, list(drafts), vocab_size) if req.grammar is not None else []
    row = SampleRow(
        index=index, temperature=p.temperature, top_p=p.top_p,
        top_k=p.top_k, min_p=p.min_p, presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty, repetition_penalty=p.repetition_penalty,
        logprobs=p.logprobs, seed=p.seed, output_pos=req.num_output_tokens,
        draft_token_ids=list(drafts), allowed=allowed)
    if not row.penalised:
        return row
    prompt_ids, output_ids, start = ((req.prompt_token_ids, req.output_token_ids, 0)
                                     if plan is None else plan.history(index))
    return msgspec.structs.replace(row, prompt_ids=prompt_ids, output_ids=output_ids,
                                   output_start=start)


def _grammar_masks(req: Request, drafts: list[int], vocab_size: int) -> list[bytes]:
    """The allowed-token mask before each draft and after the last; the matcher ends where it
    began. Drafts were checked against the grammar when proposed (`Speculator.propose`)."""
    masks, advanced = [], 0
    try:
        for j in range(len(drafts) + 1):
            if req.grammar.is_terminated():  # a draft stop token: the output ends there, so
                masks.append(masks[-1])  # what this position may hold never matters
                continue
            row = torch.zeros(vocab_size)
            req.grammar.fill_mask(row)  # forbidden tokens become -inf
            masks.append(np.packbits(~row.isinf().numpy()).tobytes())
            if j < len(drafts) and not req.grammar.is_terminated():
                if not req.grammar.accept(drafts[j]):
                    raise RuntimeError(f"draft token {drafts[j]} is not allowed by the grammar")
                advanced += 1
    finally:
        req.grammar.rollback(advanced)
    return masks


class StepBuilder:
    """Flattens a SchedulerOutput into a StepCommand (both executors use this one path). It
    remembers what it sent per request slot (`SentSlots`), so it is one per executor."""

    def __init__(self, block_size: int, vocab_size: int) -> None:
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.sent = SentSlots()

    def build(self, out, num_micro_batches: int = 1) -> tuple[StepCommand, list[Request]]:
        """(command, the request of each sample row in order)."""
        input_ids, query_lens, context_lens, samples, sampled = [], [], [], [], []
        num_known, new_blocks, checksum = [], [], 0
        plan = self.sent.plan(out.scheduled)
        for i, (req, num_new) in enumerate(out.scheduled):
            start = req.num_computed_tokens
            drafts = out.drafts.get(req.request_id, [])
            input_ids.extend(req.all_token_ids[start : start + num_new])
            input_ids.extend(drafts)
            query = num_new + len(drafts)
            query_lens.append(query)
            context_lens.append(start + query)
            num_blocks = cdiv(start + query, self.block_size)
            known, new = plan.blocks(i, num_blocks)
            num_known.append(known)
            new_blocks.append(new)
            checksum += table_checksum_term(i, req.block_ids[:num_blocks])
            if start + num_new >= req.num_tokens:
                samples.append(make_sample_row(req, i, self.vocab_size, drafts, plan))
                sampled.append(req)
        sizes = split_micro_batches(query_lens, num_micro_batches)
        cmd = StepCommand(input_ids, query_lens, context_lens, plan.slots, num_known, new_blocks,
                          checksum, sizes, samples, plan.freed)
        plan.commit()
        return cmd, sampled

    def step_failed(self) -> None:
        """The executor raised on the last command and may not have applied it: the next one
        resends its requests' tables (and histories) whole."""
        self.sent.forget_last()


def to_step_tokens(result: SampleResult, requests: list[Request],
                   rows: list[SampleRow]) -> list[StepTokens]:
    """`requests[i]` and `rows[i]` are the request and row of the result's row i."""
    if result.error is not None:
        raise RuntimeError(f"sampling failed: {result.error}")
    out = []
    for req, row, got in zip(requests, rows, result.rows, strict=True):
        lps = []
        k = req.params.logprobs
        if k is not None:
            for j, token in enumerate(got.token_ids):
                top = (list(zip(got.top_ids[j][:k], got.top_logprobs[j][:k]))
                       if k > 0 and got.top_ids else [])
                lps.append(Logprob(token, got.logprobs[j], top))
        out.append(StepTokens(req, list(got.token_ids), lps, len(row.draft_token_ids)))
    return out


def split_micro_batches(num_tokens: list[int], num_micro_batches: int) -> list[int]:
    """Cut a step's requests (in order) into <= num_micro_batches contiguous groups of about
    equal token count; returns the number of requests in each group (no empty groups).

    A request is never split, so one long prefill alone in a step is one micro-batch.
    """
    n = len(num_tokens)
    m = max(1, min(num_micro_batches, n))
    total = sum(num_tokens)
    sizes, count, acc, cut = [], 0, 0, 1
    for i, tokens in enumerate(num_tokens):
        count += 1
        acc += tokens
        remaining_requests = n - i - 1
        remaining_groups = m - len(sizes) - 1
        # Close the group once it reaches its share, or when every later request must start
        # a group of its own to reach m groups.
        if remaining_groups > 0 and (acc * m >= total * cut
                                     or remaining_requests == remaining_groups):
            sizes.append(count)
            count, cut = 0, cut + 1
    sizes.append(count)
    return [s for s in sizes if s]


class Executor(Protocol):
    """What the engine needs of whatever runs its steps: `ModelRunner` (hearth/engine/runner.py,
    the model in this process) or `ParallelExecutor` (hearth/engine/parallel/parallel_executor.py, the
    T x P rank set driven by messages). `make_executor` (executor.py) picks one."""

    num_blocks: int  # KV blocks each rank's cache holds (the engine's pool mirrors them)
    num_micro_batches: int  # how many pieces `StepBuilder` cuts a step into (pipeline stages)

    @property
    def kv_cache(self) -> torch.Tensor:
        """The one KV tensor `[layers, planes, num_blocks, block_size, heads, dim]` that PD
        transfer and the KV tiers read and write (one process only: a rank set raises)."""
        ...

    def execute(self, cmd: StepCommand) -> SampleResult:
        """Run one step. Its first act is `StepReceiver.receive(cmd)` (every command, in order:
        the tables it reads are deltas on the ones before); if it raises, the engine has the
        builder resend the step's requests whole."""
        ...

    def expert_load(self) -> dict[int, list[int]]:
        """Tokens routed to each expert since start per MoE layer; {} when not counted."""
        ...

    def close(self) -> None: ...

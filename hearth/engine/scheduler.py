"""The phase-free scheduler.

Every step grants each request up to its remaining uncomputed tokens within one token budget:
decoding requests first (each its one token, or the tokens a grammar forced), then running
prompts' next chunks, then waiting requests while the running set has room. Prompt tokens
(chunks and new prompts alike) also stay within the step policy's prompt budget, which is
smaller while anyone decodes, so no stream's next token waits behind a long chunk; and the
waiting request admitted next is the step policy's pick: a session's next turn, whose prompt
is mostly cached, may pass colder ones a bounded number of times (hearth/engine/step_policy.py).
A prefix-cache hit is simply tokens that are already computed. When the pool runs out of
blocks, the most recently admitted running request is preempted (its blocks freed, to be
recomputed later; its prefix stays cached); a prompt chunk never preempts a request already
granted in the same step (it waits: a decode that needs a block makes the newest give way).

Contract with the runner: `SchedulerOutput.scheduled` lists (request, num_new_tokens); the runner
computes tokens [num_computed_tokens, num_computed_tokens + num_new_tokens) of each request and
samples a token for every request whose computed tokens then reach `num_tokens`.

Speculative decoding: a decoding request (exactly one uncomputed token) that carries draft
tokens (`Request.spec_token_ids`, proposed before the step) is granted them too, budget and
blocks permitting: `SchedulerOutput.drafts[request_id]` lists the drafts it computes after its
own token. Drafts are the first thing dropped when blocks are short (before anyone is
preempted), and a step that will compute prompt tokens grants none. After the step, `commit`
advances each request by what was kept (hearth/engine/step.py has the whole step contract).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from itertools import islice
from typing import Callable, Iterator

from hearth.config import SchedulerConfig
from hearth.engine.kv.cache import KVCacheManager
from hearth.engine.request import Request, RequestStatus
from hearth.engine.step_policy import (StepCost, WaitingView, is_warm, pick_next_waiting,
                                       prompt_allowance, prompt_token_budget)

ADMIT_SCAN = 16  # waiting requests looked at for a warm next turn, from the head


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (request, new tokens)
    preempted: list[Request] = field(default_factory=list)
    kv_imports: list[Request] = field(default_factory=list)  # admitted to wait for a KV transfer
    kv_loads: list[Request] = field(default_factory=list)  # admitted to wait for a KV tier load
    drafts: dict[str, list[int]] = field(default_factory=dict)  # request_id -> draft tokens granted
    num_batched_tokens: int = 0
    num_prompt_tokens: int = 0  # of those, granted to requests still computing their prompt

    @property
    def empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int,
                 cost: StepCost | None = None) -> None:
        """`cost`: the measured step costs the prompt budget follows (with
        `config.itl_target_ms`); None: only `max_prompt_tokens_while_decoding` bounds it."""
        self.config = config
        self.cost = cost
        self.kv = kv
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self._warm_exemption = True  # this step's pass past the prompt bound (step_policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.importing: list[Request] = []  # blocks allocated, KV arriving from a prefill worker
        # (request, pool hits) -> blocks after them held by a KV tier (kv/tiers.py); None: no tiers
        self.store_lookup: Callable[[Request, int], int] | None = None
        # (request, pool hits, n) -> whether those n tier blocks are read ahead into host memory,
        # and -> how many of them were copied into its blocks (kv/tiers.py: prefetch)
        self.store_ready: Callable[[Request, int, int], bool] | None = None
        self.store_fill: Callable[[Request, int, int], int] | None = None

    def add(self, request: Request) -> None:
        self.waiting.append(request)
        self.requests[request.request_id] = request

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.importing)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        # A step that will compute prompt tokens (a running prompt's next chunk, or a waiting
        # request with a free seat) verifies no drafts: their rows (up to 8 per decoding
        # request, each attending over its whole context) would lengthen the step a new agent
        # turn waits on, and take budget from its prompt. Engine-alone agent replay (8 sessions,
        # AMX Xeon): later-turn TTFT p50 91-93 -> 65-75 ms at the same wall. The decodes draft
        # again from the next pure decode step. (A waiting request that cannot get blocks also
        # holds drafts back while it waits; blocks that short drop drafts anyway.)
        prompt_step = any(r.num_tokens - r.num_computed_tokens > 1 for r in self.running) or (
            bool(self.waiting)
            and len(self.running) + len(self.importing) < self.config.max_num_seqs)
        decoding = [r for r in self.running if is_decoding(r)]
        prompts = [r for r in self.running if not is_decoding(r)]
        budget = self.config.max_num_batched_tokens
        prompt_budget = prompt_token_budget(self.config, self.cost, len(decoding))
        self._warm_exemption = True  # one warm turn per step may pass the prompt bound
        stalled = False  # a request preempted itself: nothing more fits this step
        for req in decoding:
            if budget <= 0 or stalled:
                break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted by an earlier one in this loop
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            drafts = [] if prompt_step else self._grantable_drafts(req, num_new, budget)
            granted = self._grant(out, req, num_new, drafts)
            stalled = granted is None
            budget -= granted or 0
        for req in prompts:
            if budget <= 0 or stalled:
                break
            if req.status is not RequestStatus.RUNNING:
                continue
            left = req.num_tokens - req.num_computed_tokens
            num_new = min(left, budget, self._allowance(prompt_budget, left, req.warm_turn))
            if num_new <= 0:
                continue  # the step's prompt bound is spent; a warm turn behind it may still go
            granted = self._grant(out, req, num_new, [])
            if granted == 0:
                break  # its blocks would come from a request granted this step: it waits
            stalled = granted is None
            self._spend_exemption(prompt_budget, granted or 0)
            budget -= granted or 0
            prompt_budget -= granted or 0
            out.num_prompt_tokens += granted or 0
        if not out.preempted:
            budget = self._admit_waiting(out, budget, prompt_budget)
        out.num_batched_tokens = self.config.max_num_batched_tokens - budget
        return out

    def _grant(self, out: SchedulerOutput, req: Request, num_new: int,
               drafts: list[int]) -> int | None:
        """Give a running request `num_new` tokens (and `drafts` if blocks allow), preempting
        the newest running requests while blocks are short. The tokens granted; 0 if the
        newest is already granted this step (nothing preempted); None if `req` itself was
        the newest and gave way."""
        if drafts and not self.kv.allocate(req, num_new + len(drafts)):
            drafts = []  # blocks are short: drop the drafts before preempting anyone
        while not drafts and not self.kv.allocate(req, num_new):
            victim = self.running[-1]  # the newest request gives way
            if any(r is victim for r, _ in out.scheduled):
                return 0
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is req:
                return None
        out.scheduled.append((req, num_new))
        if drafts:
            out.drafts[req.request_id] = drafts
        return num_new + len(drafts)

    def _grantable_drafts(self, req: Request, num_new: int, budget: int) -> list[int]:
        """The request's drafts that fit: only for a decode (one uncomputed token), within the
        token budget and the context length."""
        drafts = req.spec_token_ids
        if not drafts or num_new != 1 or req.num_tokens - req.num_computed_tokens != 1:
            return []
        room = min(budget - num_new, self.max_model_len - req.num_tokens - 1)
        return drafts[:max(0, room)]

    def commit(self, req: Request, num_new: int, tokens: list[int], num_drafted: int) -> None:
        """Apply one step's result to a request: it computed `num_new` of its own tokens plus
        `num_drafted` drafts and produced `tokens` (accepted drafts, then one sampled token;
        [] if it did not sample, or the part kept before a stop). Its KV is valid for its own
        tokens and the accepted drafts; only those count as computed, so the blocks of rejected
        drafts are never entered in the prefix cache."""
        accepted = min(num_drafted, max(0, len(tokens) - 1))
        for token in tokens:
            req.append_token(token)
        req.num_computed_tokens += num_new + accepted
        self.kv.register_computed_blocks(req)

    def _admit_waiting(self, out: SchedulerOutput, budget: int, prompt_budget: int) -> int:
        while (self.waiting and budget > 0 and (prompt_budget > 0 or self._warm_exemption)
               and len(self.running) + len(self.importing) < self.config.max_num_seqs):
            # (bound spent and the exemption used: nobody may pass, so skip the prefix lookups)
            req, hits = self._next_waiting()
            warm = req.kv_import is None and is_warm(len(hits) * self.kv.block_size, req.num_tokens)
            new_tokens = req.num_tokens - len(hits) * self.kv.block_size
            if self._allowance(prompt_budget, new_tokens, warm) <= 0:
                break  # the step's prompt bound is spent and the next pick is no short warm turn
            if req.kv_import is not None:  # its prompt's KV comes over the wire, not from compute
                if not self._admit_import(req, hits, out):
                    break
                continue
            num_stored = self.store_lookup(req, len(hits)) if self.store_lookup else 0
            if num_stored and self.store_ready and self.store_ready(req, len(hits), num_stored):
                cap = min(budget, self._allowance(prompt_budget, new_tokens, warm))
                left = self._admit_filled(req, hits, num_stored, out, cap)
                if left is None:
                    break
                self._spend_exemption(prompt_budget, cap - left)
                out.num_prompt_tokens += cap - left
                budget, prompt_budget = budget - (cap - left), prompt_budget - (cap - left)
                continue
            if num_stored:  # its prefix continues in a lower tier: load it, don't recompute
                if not self._admit_load(req, hits, num_stored, out):
                    break
                continue
            num_new = min(new_tokens, budget, self._allowance(prompt_budget, new_tokens, warm))
            if not self.kv.allocate(req, num_new, hits):
                break  # wait for blocks; admission order is kept (no overtaking)
            self._take_waiting(req, hits, RequestStatus.RUNNING)
            req.warm_turn = warm
            self._spend_exemption(prompt_budget, num_new)
            self.running.append(req)
            out.scheduled.append((req, num_new))
            out.num_prompt_tokens += num_new
            budget -= num_new
            prompt_budget -= num_new
        return budget

    def _allowance(self, prompt_budget: int, num_new_tokens: int, warm: bool) -> int:
        """Prompt tokens a request may compute in this step (step_policy.prompt_allowance); a
        warm turn passes the bound only while this step's one exemption is unused."""
        return prompt_allowance(prompt_budget, num_new_tokens, warm and self._warm_exemption)

    def _spend_exemption(self, prompt_budget: int, granted: int) -> None:
        """A grant past what was left of the bound used the step's warm exemption: the next
        warm turn waits for the next step (one at a time finishes each sooner on average than
        all in one longer step)."""
        if granted > max(prompt_budget, 0):
            self._warm_exemption = False

    def _next_waiting(self) -> tuple[Request, list]:
        """The waiting request to admit next (the step policy's pick among the first
        ADMIT_SCAN) and its prefix-cache hits."""
        hits_of: dict[int, list] = {}

        def views() -> Iterator[WaitingView]:
            for i, req in enumerate(islice(self.waiting, ADMIT_SCAN)):
                hits_of[i] = hits = self.kv.find_cached_prefix(req)
                warm = req.kv_import is None and is_warm(len(hits) * self.kv.block_size,
                                                         req.num_tokens)
                yield WaitingView(warm, req.num_bypassed)

        index = pick_next_waiting(views(), self.config.next_turn_max_bypass)
        req = self.waiting[index]
        hits = hits_of[index] if index in hits_of else self.kv.find_cached_prefix(req)
        return req, hits

    def _admit_import(self, req: Request, hits: list, out: SchedulerOutput) -> bool:
        """Adopt the local prefix hits, allocate blocks for the rest of the prompt and park the
        request until a transfer fills them (no token budget: nothing is computed)."""
        num_new = req.num_prompt_tokens - len(hits) * self.kv.block_size
        return self._park(req, hits, num_new, out.kv_imports)

    def _admit_load(self, req: Request, hits: list, num_stored: int, out: SchedulerOutput) -> bool:
        """Like an import: adopt the pool's hits, allocate the `num_stored` blocks that follow
        and park the request until the store has filled them (no token budget)."""
        return self._park(req, hits, num_stored * self.kv.block_size, out.kv_loads)

    def _admit_filled(self, req: Request, hits: list, num_stored: int, out: SchedulerOutput,
                      budget: int) -> int | None:
        """Its tier blocks were read ahead: allocate them (as a load would), copy them in now and
        run it; the rest of its prompt is scheduled in this step if blocks allow, else it grows
        from the running queue next step like a loaded request. The budget left, or None if
        blocks are short."""
        bs = self.kv.block_size
        if not self.kv.allocate(req, num_stored * bs, hits):
            return None
        self._take_waiting(req, hits, RequestStatus.RUNNING)
        req.num_computed_tokens += self.store_fill(req, len(hits), num_stored) * bs
        self.kv.register_computed_blocks(req)
        self.running.append(req)
        num_new = min(req.num_tokens - req.num_computed_tokens, budget)
        if self.kv.allocate(req, num_new):
            out.scheduled.append((req, num_new))
            budget -= num_new
        return budget

    def _park(self, req: Request, hits: list, num_new: int, into: list[Request]) -> bool:
        if not self.kv.allocate(req, num_new, hits):
            return False
        self._take_waiting(req, hits, RequestStatus.WAITING_FOR_KV)
        self.importing.append(req)
        into.append(req)
        return True

    def _take_waiting(self, req: Request, hits: list, status: RequestStatus) -> None:
        """Move a waiting request on (each one ahead of it counts a bypass); its first
        admission fixes its cache-hit count and queue time (a preempted request keeps them)."""
        if self.waiting[0] is req:
            self.waiting.popleft()
        else:
            for ahead in islice(self.waiting, self.waiting.index(req)):
                ahead.num_bypassed += 1
            self.waiting.remove(req)
        if req.num_cached_tokens < 0:  # prompt tokens only (a resumed output's may hit too)
            req.num_cached_tokens = min(len(hits) * self.kv.block_size, req.num_prompt_tokens)
        if req.first_scheduled_time is None:
            req.first_scheduled_time = time.monotonic()
        req.status = status

    def complete_import(self, req: Request, num_computed_tokens: int) -> None:
        """The transfer into `req`'s blocks has ended: run it from `num_computed_tokens`, or free
        its blocks now if it was finished (aborted) meanwhile."""
        self.importing.remove(req)
        req.kv_import = None
        if req.is_finished:
            self.kv.free(req)
            return
        req.num_computed_tokens = num_computed_tokens
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(req)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Remove a request (finished, aborted or failed) and release its blocks."""
        req.status = status
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        elif req in self.importing:  # a transfer may still write its blocks: see complete_import
            self.requests.pop(req.request_id, None)
            return
        self.kv.free(req)
        self.requests.pop(req.request_id, None)

    def num_prefill_tokens_inflight(self) -> int:
        """Uncomputed prompt tokens of waiting and running requests (the router's prefill load)."""
        return sum(max(0, r.num_prompt_tokens - r.num_computed_tokens)
                   for r in list(self.waiting) + self.running if r.kv_import is None)

    def num_decode_tokens_active(self) -> int:
        """Context tokens of running requests past their prompt (the router's decode load)."""
        return sum(r.num_tokens for r in self.running if r.num_computed_tokens >= r.num_prompt_tokens)


def is_decoding(req: Request) -> bool:
    """Past its prompt: its uncomputed tokens are its latest sampled (or grammar-forced) ones."""
    return req.num_computed_tokens >= req.num_prompt_tokens

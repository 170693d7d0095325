"""Speculative decoding: propose draft tokens per request, let the step verify them.

Each step, before scheduling, `Speculator.propose` gives every decoding request up to k draft
tokens (`Request.spec_token_ids`) from its proposer (hearth/engine/speculative/proposers.py); the
scheduler grants them with the request's own token, the executor computes all of them in the
same forward pass as every other request, and the sampler keeps the drafts the model agrees with
(hearth/engine/step.py has the rule and why the output distribution is unchanged).

Adaptive: a request's draft length follows its recent acceptance (an exponential average of
accepted / drafted); one that keeps rejecting only probes with a single token now and then.
Cost-aware: with `cost` (the engine's StepCost) a draft's i-th token is proposed only while
acceptance^i (its chance to be kept, taking acceptance per token) exceeds what its row costs
against the step (step_policy.draft_break_even, from the measured seconds per row): on a
compute-bound step of many rows, only requests whose drafts nearly always land keep drafting.
When more than `max_batch` requests decode at once, nobody drafts. Guided requests draft too:
a draft is cut at the first token its grammar forbids, and the matcher is rolled back.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from hearth.config import SpeculativeConfig
from hearth.engine.request import Request
from hearth.engine.speculative.proposers import NgramProposer, SuffixProposer
from hearth.engine.step_policy import StepCost, draft_break_even

log = logging.getLogger("hearth.engine")
PROBE_EVERY = 4  # a request with low acceptance drafts one token every this many steps


@dataclass
class SpecCounters:
    """Totals since start, exported on /metrics under vLLM's spec_decode names."""

    num_drafts: int = 0  # request-steps that verified at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)


@dataclass
class _State:
    acceptance: float = 1.0  # exponential average of accepted / drafted
    steps: int = 0
    failed: bool = False  # its proposer raised: no more drafts for this request


def make_speculator(engine_config, vocab_size: int, executor=None) -> Speculator | None:
    """`executor`: the engine's (eagle3 reads the target's hidden states from it)."""
    if engine_config.speculative.method == "off":
        return None
    return Speculator(engine_config, vocab_size, executor)


class Speculator:
    def __init__(self, engine_config, vocab_size: int, executor=None) -> None:
        config: SpeculativeConfig = engine_config.speculative
        self.config = config
        self.vocab_size = vocab_size
        if config.method == "ngram":
            self.proposer = NgramProposer(config)
        elif config.method == "suffix":
            self.proposer = SuffixProposer(config)
        elif config.method == "eagle3":
            from hearth.engine.speculative.eagle3 import Eagle3Proposer
            self.proposer = Eagle3Proposer(config, executor)
        else:
            from hearth.engine.speculative.draft_model import DraftModelProposer
            self.proposer = DraftModelProposer(config, engine_config, vocab_size)
        self.method = self.proposer.name
        self.counters = SpecCounters(accepted_per_position=[0] * config.num_speculative_tokens)
        self._states: dict[str, _State] = {}
        self.cost: StepCost | None = None  # set by the engine: measured step costs

    def propose(self, running: list[Request]) -> None:
        """Set `spec_token_ids` of every running request (most to [])."""
        decoding = []
        for req in running:
            req.spec_token_ids = []
            if req.num_tokens - req.num_computed_tokens == 1 and req.kv_import is None:
                decoding.append(req)
        if len(decoding) > self.config.max_batch:
            return
        wants = []
        break_even = draft_break_even(self.cost, len(decoding))
        for req in decoding:
            state = self._states.setdefault(req.request_id, _State())
            state.steps += 1
            k = self._draft_len(req, state, break_even)
            if k > 0:
                wants.append((req, k))
        if not wants:
            return
        for (req, k), drafts in zip(wants, self._proposals(wants)):
            drafts = drafts[:k]
            if drafts and req.grammar is not None:
                drafts = _grammar_prefix(req, drafts)
            req.spec_token_ids = drafts

    def _proposals(self, wants: list[tuple[Request, int]]) -> list[list[int]]:
        """The proposer's drafts; where it raises, each request alone, and a request whose own
        proposal raises gets no drafts from then on (its tokens still come, undrafted)."""
        try:
            return self.proposer.propose_many(wants)
        except Exception:
            log.exception("%s drafts for %d requests failed; retrying them one by one",
                          self.method, len(wants))
        out = []
        for req, k in wants:
            try:
                out.append(self.proposer.propose_many([(req, k)])[0])
            except Exception:
                log.exception("%s drafts for %s failed: it decodes without drafts",
                              self.method, req.request_id)
                self._fail(req.request_id)
                out.append([])
        return out

    def _fail(self, request_id: str) -> None:
        self._states.setdefault(request_id, _State()).failed = True
        try:
            self.proposer.drop(request_id)
        except Exception:
            log.exception("dropping the %s state of %s failed", self.method, request_id)

    def computed(self, requests: list[Request], query_lens: list[int],
                 context_lens: list[int]) -> None:
        """The executor computed `query_lens[i]` tokens of `requests[i]` up to `context_lens[i]`
        (for a proposer that reads the target's hidden states; the others ignore it). A
        request whose part of it fails decodes without drafts from then on."""
        computed = getattr(self.proposer, "computed", None)
        if computed is None:
            return
        try:
            skip = {r.request_id for r in requests
                    if r.request_id in self._states and self._states[r.request_id].failed}
            failed = computed(requests, query_lens, context_lens, skip)
        except Exception:
            log.exception("%s: filing a step's hidden states failed; its %d requests decode "
                          "without drafts", self.method, len(requests))
            failed = [req.request_id for req in requests]
        for request_id in failed:
            self._fail(request_id)

    def _draft_len(self, req: Request, state: _State, break_even: float = 0.0) -> int:
        if state.failed:
            return 0
        remaining = req.params.max_tokens - req.num_output_tokens - 1  # the step's own token
        if remaining <= 0:
            return 0
        k = self.config.num_speculative_tokens
        probe = 1 if state.steps % PROBE_EVERY == 0 and break_even < 1.0 else 0
        if state.acceptance < 0.2:
            k = probe
        else:
            k = max(1, round(k * min(1.0, 1.5 * state.acceptance)))
            if break_even > 0.0:
                k = min(k, worth_drafting(state.acceptance, break_even)) or probe
        return min(k, remaining)

    def observe(self, req: Request, num_drafted: int, num_accepted: int) -> None:
        """A step verified `num_drafted` drafts of `req` and kept `num_accepted`."""
        c = self.counters
        c.num_drafts += 1
        c.num_draft_tokens += num_drafted
        c.num_accepted_tokens += num_accepted
        for i in range(min(num_accepted, len(c.accepted_per_position))):
            c.accepted_per_position[i] += 1
        state = self._states.setdefault(req.request_id, _State())
        state.acceptance = 0.5 * state.acceptance + 0.5 * (num_accepted / num_drafted)

    def finished(self, req: Request) -> None:
        """Forget a finished request (its output joins the shared store, for suffix)."""
        self._states.pop(req.request_id, None)
        self.proposer.finished(req)

    def drop(self, request_id: str) -> None:
        """Forget an aborted request (nothing of it joins the shared store)."""
        self._states.pop(request_id, None)
        self.proposer.drop(request_id)

    def forget_missing(self, live_ids) -> None:
        """Drop state of requests that ended without `finished` (aborts, errors)."""
        for request_id in [r for r in self._states if r not in live_ids]:
            self._states.pop(request_id, None)
        for request_id in [r for r in self.proposer.indexes if r not in live_ids]:
            self.proposer.drop(request_id)
        for name in ("shadows", "states"):  # the draft model's, eagle3's
            for request_id in [r for r in getattr(self.proposer, name, {}) if r not in live_ids]:
                self.proposer.drop(request_id)

    def close(self) -> None:
        self.proposer.close()


MAX_PLANNED_ACCEPTANCE = 0.9  # a run of full acceptances says little about the next draft


def worth_drafting(acceptance: float, break_even: float, limit: int = 32) -> int:
    """Draft tokens whose chance to be kept (p^i for the i-th, p the acceptance taken per
    token, at most MAX_PLANNED_ACCEPTANCE) is above `break_even`."""
    p = min(acceptance, MAX_PLANNED_ACCEPTANCE)
    k, chance = 0, p
    while k < limit and chance > break_even:
        k, chance = k + 1, chance * p
    return k


def _grammar_prefix(req: Request, drafts: list[int]) -> list[int]:
    """The longest prefix of `drafts` the request's grammar allows; the matcher is unchanged."""
    n = 0
    try:
        while n < len(drafts) and req.grammar.accept(drafts[n]):
            n += 1
            if req.grammar.is_terminated():  # a stop token ends the output: nothing follows
                break
    finally:
        req.grammar.rollback(n)
    return drafts[:n]

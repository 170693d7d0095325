"""LLMEngine: one serving engine (scheduler + KV cache + runner + detokenizer), stepped by a loop.

`add_request` validates and queues; `step` schedules one batch, runs it, and returns the per-request
deltas. A failure while running a batch is isolated: each request of the batch is retried alone,
and only the ones that fail alone are finished with an error. Every finish path frees the request's
KV blocks (see `_finish`).

A guided request whose grammar is not cached waits outside the scheduler (no KV blocks, never
scheduled) while the grammar pool compiles it on another thread (`GrammarAdmission`,
hearth/engine/admission.py); each step admits the ones whose compile ended, or fails them (bad
spec, timeout). `admissions` reports those outcomes so the engine core can accept or reject
such a request only once its grammar is known.
"""

from __future__ import annotations

import logging
import time

import torch

from hearth.config import EngineConfig
from hearth.engine.kv.block_pool import BlockPool
from hearth.engine.kv.transfer_api import ConnectorFactory, KVCacheGeometry, KVTransfer
from hearth.engine.kv.cache import KVCacheManager, cdiv
from hearth.engine.admission import GrammarAdmission
from hearth.engine.guided.grammar_pool import GrammarPool
from hearth.engine.kv.store_api import StoreFactory
from hearth.engine.kv.tiers import KVTierDriver, store_namespace
from hearth.engine.kv.transfer import KVTransferDriver
from hearth.engine.refusals import Rejection, RequestRejected
from hearth.engine.request import Request, RequestOutput, RequestStatus
from hearth.engine.executor import BuiltModel, RankFailedError, amx_usable, make_executor
from hearth.engine.speculative.speculator import make_speculator
from hearth.engine.stats import EngineCounters, EngineStats
from hearth.engine.stops import check_resume
from hearth.engine.output import OutputProcessor, forced_logprob
from hearth.engine.step import Executor, StepBuilder, StepTokens, to_step_tokens
from hearth.engine.sampling_params import SamplingParams
from hearth.engine.text.tokenizer import Tokenizer
from hearth.engine.scheduler import Scheduler, SchedulerOutput
from hearth.engine.step_policy import PRIOR_PROMPT_TOKENS, StepCost, prompt_token_budget

log = logging.getLogger("hearth.engine")


class LLMEngine:
    def __init__(self, config: EngineConfig, checkpoint=None,
                 connector_factory: ConnectorFactory | None = None,
                 store_factory: StoreFactory | None = None,
                 prebuilt: BuiltModel | None = None, executor: Executor | None = None) -> None:
        """`connector_factory` (from the server, by role) enables KV export/import;
        `store_factory` the KV tiers below the pool (when `config.kv_offload` names one);
        `prebuilt` a model already built for this checkpoint and formats (`build_model_for`),
        which this engine then shares instead of building its own (T = P = 1 only);
        `executor` runs the steps instead of the one `make_executor` would make (the engine's
        unit tier drives the engine over a scripted executor this way)."""
        from hearth.models.loader import load_checkpoint, with_rope_scaling
        from hearth.models.rope_scaling import context_length

        t0 = time.monotonic()
        self.config = config
        mc, cc = config.model, config.cache
        checkpoint = (checkpoint or (prebuilt.checkpoint if prebuilt else None)
                      or load_checkpoint(mc.model))
        self.checkpoint = with_rope_scaling(checkpoint, mc.rope_scaling)
        self.arch = self.checkpoint.arch
        self.tokenizer = Tokenizer.from_checkpoint(self.checkpoint)
        self.model_name = mc.served_model_name or self.checkpoint.name
        self.max_model_len = context_length(self.arch, mc.max_model_len)
        torch.manual_seed(mc.seed)
        # ModelRunner in this process, or the driver of T x P rank processes (same interface).
        self.executor: Executor = executor or make_executor(config, self.checkpoint, prebuilt)
        num_blocks = self.executor.num_blocks
        self.step_builder = StepBuilder(cc.block_size, self.arch.vocab_size)
        try:  # a bad draft (an EAGLE head that does not fit the model) is refused here
            self.speculator = make_speculator(config, self.arch.vocab_size, self.executor)
        except BaseException:
            self.executor.close()
            raise
        self._num_steps = 0
        self.block_size = cc.block_size
        self.pool = BlockPool(num_blocks, cc.enable_prefix_caching)
        self.kv = KVCacheManager(self.pool, cc.block_size)
        # Prompt tokens a step may carry beside decodes follow the measured step costs
        # (hearth/engine/step_policy.py), from a prior per CPU kind until they are measured.
        self.step_cost = StepCost(PRIOR_PROMPT_TOKENS["amx" if amx_usable() else "other"])
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len, self.step_cost)
        if self.speculator is not None:
            self.speculator.cost = self.step_cost  # draft lengths weigh a row's measured cost
        self._step_start = 0.0  # when the running step began, and its tokens (stamped on a
        self._step_tokens = 0  # request whose first token it samples)
        self.eos_token_ids = tuple(self.tokenizer.eos_token_ids)
        self.outputs = OutputProcessor(self.tokenizer, self.eos_token_ids, self.max_model_len)
        self._aborted: list[Request] = []
        self._resumed: list[RequestOutput] = []  # resumed requests' first outputs, next step
        self.grammars = GrammarAdmission(self._grammar_compiler, config.guided)
        # forced: output tokens appended by jump-forward, without a decode step (in generation)
        self.counters = EngineCounters()
        self.pd: KVTransferDriver | None = None
        if connector_factory is not None:
            kv_cache = self.executor.kv_cache  # [layers, planes, num_blocks, block_size, heads, dim]
            geometry = KVCacheGeometry.of(kv_cache, cc.block_size)
            connector = connector_factory(config.kv_transfer, kv_cache, geometry)
            self.pd = KVTransferDriver(connector, self.scheduler, self.kv, self.arch.vocab_size)
        self.tiers: KVTierDriver | None = None
        if store_factory is not None and config.kv_offload.enabled:
            kv_cache = self.executor.kv_cache  # [layers, planes, num_blocks, block_size, heads, dim]
            geometry = KVCacheGeometry.of(kv_cache, cc.block_size)
            store = store_factory(config.kv_offload, kv_cache, geometry,
                                  store_namespace(mc, geometry))
            self.tiers = KVTierDriver(store, self.scheduler, self.kv,
                                      config.kv_offload.load_timeout_seconds,
                                      write_through=config.kv_offload.write_through)
        self.load_seconds = time.monotonic() - t0
        log.info("engine ready in %.2fs: %s, %d KV blocks of %d tokens", self.load_seconds,
                 self.model_name, num_blocks, cc.block_size)

    # ---- requests -------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        n = len(prompt_token_ids)
        if n == 0:
            raise RequestRejected("prompt", "prompt: must contain at least one token")
        too_long = "context_length_exceeded"
        if n >= self.max_model_len:
            raise RequestRejected("prompt", f"prompt: {n} tokens, but the model's context length "
                                  f"is {self.max_model_len} (at least one token must remain for "
                                  f"output)", too_long)
        if cdiv(n + 1, self.block_size) > self.pool.num_blocks:
            raise RequestRejected("prompt", f"prompt: {n} tokens do not fit in the KV cache "
                                  f"({self.pool.num_blocks} blocks of {self.block_size} tokens)",
                                  too_long)
        bad = [t for t in prompt_token_ids if not 0 <= t < self.arch.vocab_size]
        if bad:
            raise RequestRejected("prompt", f"prompt: token id {bad[0]} outside the vocabulary "
                                  f"[0, {self.arch.vocab_size})")

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, kv_transfer: KVTransfer | None = None,
                    output_token_ids: list[int] = ()) -> Request:
        """Queue a request. `output_token_ids`: a resumed stream's output so far, generated
        elsewhere with the same params; they are checked and reported as this request's first
        output (see `_resume`), then computed with the prompt and sampling goes on after them."""
        if request_id in self.scheduler.requests or request_id in self.grammars:
            raise RequestRejected("request_id", f"request_id: {request_id!r} is already running")
        self.validate(prompt_token_ids, params)
        output_token_ids = list(output_token_ids)
        if output_token_ids:
            if kv_transfer is not None:
                raise RequestRejected("kv_transfer", "kv_transfer: a resumed output has no "
                                      "prefill/decode hop")
            check_resume(output_token_ids, len(prompt_token_ids), params.max_tokens,
                         self.arch.vocab_size, self.max_model_len,
                         self.pool.num_blocks * self.block_size)
        kv_handle = self._check_kv_transfer(kv_transfer, prompt_token_ids, params)
        req = Request(request_id, prompt_token_ids, params, eos_token_ids=self.eos_token_ids)
        ticket = self.grammars.attach(req)  # a cached grammar: req.grammar set, no ticket
        self.outputs.open(request_id, params)
        if ticket is not None:
            self.grammars.park(req, ticket, kv_transfer, kv_handle, output_token_ids)
            return req
        resumed = self._enqueue(req, kv_transfer, kv_handle, output_token_ids)
        if resumed is not None:
            self._resumed.append(resumed)
        return req

    def _enqueue(self, req: Request, kv_transfer: KVTransfer | None, kv_handle,
                 output_token_ids: list[int]) -> RequestOutput | None:
        """Into the scheduler; a resumed request's given tokens are its first output (returned;
        a request they already end never enters the scheduler)."""
        resumed = None
        if kv_transfer is not None:
            self._attach_kv_transfer(req, kv_transfer, kv_handle)
        elif output_token_ids:
            resumed = self._resume(req, output_token_ids)
            if req.is_finished:
                return resumed
        self.scheduler.add(req)
        return resumed

    def _enqueue_admitted(self, wait) -> RequestOutput | None:
        """A parked request whose grammar compiled (hearth/engine/admission.py)."""
        return self._enqueue(wait.request, wait.kv_transfer, wait.kv_handle,
                             wait.output_token_ids)

    def _resume(self, req: Request, token_ids: list[int]) -> RequestOutput:
        """Take `token_ids` as generated: checked like sampled tokens (stops, grammar, length),
        appended uncomputed (the first step computes prompt + them, prefix hits included) and
        reported with their text. Their logprob entries, if asked, are placeholders: the
        router that resumes drops them (the client had the real ones). RequestRejected (and
        nothing kept) if the grammar refuses one or the output ends before the last."""
        try:
            checked = self.outputs.check_resumed(req, token_ids)
        except RequestRejected:
            self.outputs.drop(req.request_id)
            raise
        tokens = checked.kept + checked.forced
        for token in tokens:
            req.append_token(token)
        logprobs = [forced_logprob(t) for t in tokens] if req.params.logprobs is not None else []
        req.output_logprobs.extend(logprobs)
        if checked.status is not None:  # it never runs: finished here, no blocks held
            req.status = checked.status
            checked.text += self.outputs.final_text(req)
        return self.outputs.output(req, tokens, checked.text, logprobs)

    @property
    def admissions(self) -> list[tuple[str, Rejection | None]]:
        """(request_id, rejection or None) of each grammar wait the last step ended; a
        rejected request also had a finished "error" output in that step."""
        return self.grammars.admissions

    def is_waiting_for_grammar(self, request_id: str) -> bool:
        return request_id in self.grammars

    def _check_kv_transfer(self, kv_transfer, prompt_token_ids, params) -> object | None:
        if kv_transfer is None:
            return None
        if self.pd is None:
            raise RequestRejected("kv_transfer",
                                  "kv_transfer: this worker has no KV connector (role 'both')")
        return self.pd.check(kv_transfer, prompt_token_ids, params)

    def _attach_kv_transfer(self, req: Request, kv_transfer: KVTransfer, handle) -> None:
        try:
            self.pd.attach(req, kv_transfer, handle)
        except ValueError:
            self.outputs.drop(req.request_id)
            raise
        if kv_transfer.role == "decode":
            # The prefill hop already returned the first token's text; the detokenizer still
            # needs it as context (and for stop strings that span it).
            self.outputs.push_context(req.request_id, [kv_transfer.first_token_id])

    def _grammar_compiler(self):
        from hearth.engine.guided.grammar import GrammarCompiler

        return GrammarCompiler(self.tokenizer, self.arch.vocab_size)

    def grammar_pool(self) -> GrammarPool:
        return self.grammars.pool

    def abort_request(self, request_id: str) -> None:
        parked = self.grammars.abort(request_id)
        if parked is not None:  # never reached the scheduler: it holds no blocks
            parked.status = RequestStatus.FINISHED_ABORTED
            self._aborted.append(parked)
            return
        req = self.scheduler.requests.get(request_id)
        if req is not None:
            if self.pd is not None:
                self.pd.abort(req)
            self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
            self._aborted.append(req)
            if self.speculator is not None:
                self.speculator.drop(request_id)

    def has_unfinished(self) -> bool:
        return (self.scheduler.num_unfinished > 0 or bool(self._aborted)
                or len(self.grammars) > 0 or bool(self._resumed))

    # ---- stepping -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self.pd is not None:
            self.pd.poll()  # free released leases, resume requests whose KV arrived
        if self.tiers is not None:
            self.tiers.poll()  # resume requests whose blocks came back from a lower tier
        # a resumed request's first output before anything else of it (an abort included)
        outputs = self._resumed + [self.outputs.output(r, [], "") for r in self._aborted]
        self._resumed, self._aborted = [], []
        outputs += self.grammars.admit_resolved(self._enqueue_admitted,
                                                self.outputs.finished_output)
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
            self._num_steps += 1
            if self._num_steps % 256 == 0:  # aborted and failed requests leave state behind
                self.speculator.forget_missing(self.scheduler.requests)
        self._step_start = time.monotonic()
        sched = self.scheduler.schedule()
        for req in sched.preempted:
            self.counters.preemptions += 1
            if cdiv(req.num_tokens + 1, self.block_size) > self.pool.num_blocks:
                # It can never fit again, even alone: end it rather than loop forever.
                self.scheduler.finish(req, RequestStatus.FINISHED_LENGTH)
                outputs.append(self.outputs.finished_output(req))
        if self.pd is not None:
            self.pd.start_imports(sched.kv_imports)
        if self.tiers is not None:
            self.tiers.start_loads(sched.kv_loads)
        if sched.empty:
            if self.tiers is not None and self.tiers.num_loading:
                self.tiers.wait(0.005)  # only tier loads (maybe transfers) are in flight
            elif self.pd is not None:
                self.pd.wait(0.005)  # only KV transfers are in flight: don't spin
            elif len(self.grammars):
                self.grammars.wait(0.005)  # only compiles are in flight
            return outputs
        t0 = time.monotonic()
        sampled = self._execute_isolated(sched, outputs)
        self.step_cost.observe(sched.num_prompt_tokens,
                               sum(len(d) for d in sched.drafts.values()), time.monotonic() - t0,
                               num_decode_rows=len(sched.scheduled))
        outputs += self._apply_step(sched, sampled)
        return outputs

    def _execute_isolated(self, sched: SchedulerOutput, outputs: list) -> list[StepTokens]:
        try:
            return self._execute(sched)
        except RankFailedError:
            raise  # the rank set is gone: retrying requests one by one cannot help
        except Exception:
            log.exception("batch of %d failed; retrying its requests one by one",
                          len(sched.scheduled))
        sampled = []
        for req, num_new in sched.scheduled:
            alone = SchedulerOutput([(req, num_new)])
            if req.request_id in sched.drafts:
                alone.drafts[req.request_id] = sched.drafts[req.request_id]
            try:
                sampled.extend(self._execute(alone))
            except RankFailedError:
                raise
            except Exception as exc:  # this request alone fails: end it, keep the others
                log.exception("request %s failed", req.request_id)
                req.error = f"{type(exc).__name__}: {exc}"
                self.scheduler.finish(req, RequestStatus.FINISHED_ERROR)
                outputs.append(self.outputs.finished_output(req))
        return sampled

    def _execute(self, sched: SchedulerOutput) -> list[StepTokens]:
        cmd, requests = self.step_builder.build(sched, self.executor.num_micro_batches)
        try:
            result = self.executor.execute(cmd)
        except Exception:
            self.step_builder.step_failed()  # its tables may not have been applied: resend
            raise
        if self.speculator is not None:
            self.speculator.computed([req for req, _ in sched.scheduled], cmd.query_lens,
                                     cmd.context_lens)
        return to_step_tokens(result, requests, cmd.samples)

    def _apply_step(self, sched: SchedulerOutput, sampled: list[StepTokens]) -> list[RequestOutput]:
        """The one place a step's results reach its requests: advance each request by what it
        computed and kept (`Scheduler.commit`), then stop checks, detokenizing and outputs."""
        by_req = {s.request.request_id: s for s in sampled}
        self._step_tokens = sched.num_batched_tokens
        outputs = []
        for req, num_new in sched.scheduled:
            if req.is_finished:
                continue
            self.counters.computed_prompt += max(
                0, min(req.num_computed_tokens + num_new, req.num_prompt_tokens)
                - req.num_computed_tokens)
            s = by_req.get(req.request_id)
            if s is None:  # a prefill chunk that did not reach the end of the prompt
                self.scheduler.commit(req, num_new, [], 0)
                continue
            try:
                outputs.append(self._accept_tokens(req, num_new, s))
            except Exception as exc:
                log.exception("post-processing of %s failed", req.request_id)
                req.error = f"{type(exc).__name__}: {exc}"
                self.scheduler.finish(req, RequestStatus.FINISHED_ERROR)
                outputs.append(self.outputs.finished_output(req))
        return outputs

    def _accept_tokens(self, req: Request, num_new: int, s: StepTokens) -> RequestOutput:
        """Keep the step's tokens up to the first that ends the request (EOS, stop token, stop
        string, grammar end, max_tokens, context length); the rest are dropped."""
        p = req.params
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
            req.first_step_start, req.first_step_tokens = self._step_start, self._step_tokens
            self.counters.prompt += req.num_prompt_tokens
            self.counters.cached += max(0, req.num_cached_tokens)
        checked = self.outputs.check(req, s.token_ids)
        kept, forced, text, status = checked.kept, checked.forced, checked.text, checked.status
        self.scheduler.commit(req, num_new, kept, s.num_drafted)
        for token in forced:  # not computed yet: the next step runs them as one chunk
            req.append_token(token)
        self.counters.generation += len(kept) + len(forced)
        self.counters.forced += len(forced)
        new_lp = s.logprobs[: len(kept)] + [forced_logprob(t) for t in forced if p.logprobs is not None]
        req.output_logprobs.extend(new_lp)
        if self.speculator is not None and s.num_drafted:
            self.speculator.observe(req, s.num_drafted, len(kept) - 1 if status is None
                                    else min(s.num_drafted, len(s.token_ids) - 1))
        if status is None:
            return self.outputs.output(req, kept + forced, text, new_lp)
        text += self.outputs.final_text(req)
        if req.kv_transfer is not None and req.kv_transfer.role == "prefill":
            self.pd.export(req)  # the prompt's blocks stay leased instead of being freed
        self.scheduler.finish(req, status)
        if self.speculator is not None:
            self.speculator.finished(req)
        return self.outputs.output(req, kept + forced, text, new_lp)

    # ---- introspection --------------------------------------------------------------------
    def stats(self, expert_load: bool = True) -> EngineStats:
        """The load report; first applies finished KV transfers so free blocks are current.
        `expert_load=False` leaves the per-expert counts out (an empty dict: no news), as the
        core process does for most steps: DeepSeek-V3's 58 x 256 counts, listed, pickled and
        walked by the server's metrics every token, cost more than the token's HTTP work."""
        if self.pd is not None:
            self.pd.poll()
        s = self.scheduler
        pd = self.pd.counters if self.pd is not None else {}
        return EngineStats(
            num_running=len(s.running), num_waiting=len(s.waiting) + len(self.grammars),
            num_free_blocks=self.pool.num_free_blocks, num_total_blocks=self.pool.num_blocks,
            num_prefill_tokens_inflight=s.num_prefill_tokens_inflight(),
            num_decode_tokens_active=s.num_decode_tokens_active(),
            num_prompt_tokens=self.counters.prompt, num_cached_tokens=self.counters.cached,
            num_generation_tokens=self.counters.generation,
            num_preemptions=self.counters.preemptions, kv_usage=self.kv.usage(),
            num_waiting_for_kv=len(s.importing),
            num_leases_active=self.pd.num_leases() if self.pd is not None else 0,
            num_computed_prompt_tokens=self.counters.computed_prompt,
            num_transferred_tokens=pd.get("transferred_tokens", 0),
            num_transferred_blocks=pd.get("transferred_blocks", 0),
            num_transferred_bytes=pd.get("transferred_bytes", 0),
            num_kv_transfer_failures=pd.get("transfer_failures", 0),
            num_waiting_for_grammar=len(self.grammars),
            num_grammars_compiling=self.grammars.num_compiling,
            num_forced_tokens=self.counters.forced,
            kv_tiers=self.tiers.stats() if self.tiers is not None else {},
            moe_expert_tokens=self.executor.expert_load() if expert_load else {},
            prompt_tokens_while_decoding=prompt_token_budget(self.config.scheduler,
                                                             self.step_cost, num_decoding=1),
            decode_step_seconds=self.step_cost.decode_step_seconds(),
            prompt_token_seconds=self.step_cost.prompt_token_seconds(),
            **self._spec_stats(),
        )

    def _spec_stats(self) -> dict:
        if self.speculator is None:
            return {}
        c = self.speculator.counters
        return dict(num_spec_drafts=c.num_drafts, num_spec_draft_tokens=c.num_draft_tokens,
                    num_spec_accepted_tokens=c.num_accepted_tokens,
                    spec_accepted_per_position=list(c.accepted_per_position))

    def block_events_since(self, cursor: int) -> tuple[int, list[int], list[int]]:
        """(new cursor, stored hashes, evicted hashes) since `cursor`, for the router's cache
        view; a cursor older than the event window returns every retained event."""
        return self.pool.events_since(cursor)

    def tier_block_events_since(self, cursor: int) -> dict[str, tuple[list[int], list[int]]]:
        """tier -> (stored, evicted) hashes of the lower KV tiers since `cursor` (same cursor)."""
        return self.pool.tier_events_since(cursor)

    def fatal_error(self) -> str | None:
        """Why this engine can never step again (its rank set is lost), else None; the engine
        core exits on it (hearth/engine/core_process.py)."""
        return getattr(self.executor, "failure", None)  # only a rank set can lose ranks

    def kv_pool_is_whole(self) -> bool:
        if self.pd is not None:
            self.pd.poll()
        if self.tiers is not None:
            self.tiers.poll()
        self.pool.check_integrity()
        return self.pool.is_whole() and not self.scheduler.running

    def close(self) -> None:
        """Stop the KV connector (its leases end, their blocks return to the pool) and the
        executor (a T x P rank set shuts its processes down)."""
        if self.pd is not None:
            self.pd.close()
        if self.tiers is not None:
            self.tiers.close()  # running loads end; pending writes finish
        self.grammars.close()
        if self.speculator is not None:
            self.speculator.close()
        self.executor.close()

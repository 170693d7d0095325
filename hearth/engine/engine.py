"""LLMEngine: one serving engine (scheduler + KV cache + runner + detokenizer), stepped by a loop.

`add_request` validates and queues; `step` schedules one batch, runs it, and returns the per-request
deltas. A failure while running a batch is isolated: each request of the batch is retried alone,
and only the ones that fail alone are finished with an error. Every finish path frees the request's
KV blocks (see `_finish`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from hearth.config import EngineConfig
from hearth.engine.block_pool import BlockPool
from hearth.engine.detokenizer import IncrementalDetokenizer
from hearth.engine.kv_cache import KVCacheManager, cdiv
from hearth.engine.request import Request, RequestOutput, RequestStatus
from hearth.engine.runner import DTYPES, ModelRunner, SampledToken, kv_bytes_per_block
from hearth.engine.sampling_params import SamplingParams
from hearth.engine.tokenizer import Tokenizer
from hearth.models.weights import build_model
from hearth.engine.scheduler import Scheduler, SchedulerOutput

log = logging.getLogger("hearth.engine")


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    num_prefill_tokens_inflight: int
    num_decode_tokens_active: int
    num_prompt_tokens: int  # counters since start
    num_cached_tokens: int
    num_generation_tokens: int
    num_preemptions: int
    kv_usage: float


class LLMEngine:
    def __init__(self, config: EngineConfig, checkpoint=None) -> None:
        from hearth.models.loader import load_checkpoint

        t0 = time.monotonic()
        self.config = config
        mc, cc = config.model, config.cache
        self.checkpoint = checkpoint or load_checkpoint(mc.model)
        self.arch = self.checkpoint.arch
        self.tokenizer = Tokenizer.from_checkpoint(self.checkpoint)
        self.model_name = mc.served_model_name or self.checkpoint.name
        self.max_model_len = min(mc.max_model_len or self.arch.max_position_embeddings,
                                 self.arch.max_position_embeddings)
        if mc.dtype not in DTYPES:
            raise ValueError(f"dtype: unsupported {mc.dtype!r}; choose from {', '.join(DTYPES)}")
        dtype = DTYPES[mc.dtype]
        device = config.parallel.device
        torch.manual_seed(mc.seed)
        model = build_model(self.checkpoint, dtype, device)
        num_kv_heads = model.layers[0].self_attn.num_kv_heads
        per_block = kv_bytes_per_block(len(model.layers), cc.block_size, num_kv_heads,
                                       self.arch.head_dim, dtype)
        num_blocks = cc.num_blocks or max(4, int(cc.kv_cache_memory_gb * 2**30) // per_block)
        self.block_size = cc.block_size
        self.pool = BlockPool(num_blocks, cc.enable_prefix_caching)
        self.kv = KVCacheManager(self.pool, cc.block_size)
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len)
        self.runner = ModelRunner(model, num_blocks, cc.block_size, dtype, device, mc.seed)
        self.eos_token_ids = tuple(self.tokenizer.eos_token_ids)
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._aborted: list[Request] = []
        self._grammar = None
        self.counters = dict(prompt=0, cached=0, generation=0, preemptions=0)
        self.load_seconds = time.monotonic() - t0
        log.info("engine ready in %.2fs: %s, %d KV blocks of %d tokens", self.load_seconds,
                 self.model_name, num_blocks, cc.block_size)

    # ---- requests -------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("prompt: must contain at least one token")
        if n >= self.max_model_len:
            raise ValueError(f"prompt: {n} tokens, but the model's context length is "
                             f"{self.max_model_len} (at least one token must remain for output)")
        if cdiv(n + 1, self.block_size) > self.pool.num_blocks:
            raise ValueError(f"prompt: {n} tokens do not fit in the KV cache "
                             f"({self.pool.num_blocks} blocks of {self.block_size} tokens)")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.arch.vocab_size]
        if bad:
            raise ValueError(f"prompt: token id {bad[0]} outside the vocabulary "
                             f"[0, {self.arch.vocab_size})")

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams) -> Request:
        if request_id in self.scheduler.requests:
            raise ValueError(f"request_id: {request_id!r} is already running")
        self.validate(prompt_token_ids, params)
        req = Request(request_id, prompt_token_ids, params, eos_token_ids=self.eos_token_ids)
        if params.seed is not None:
            req.generator = torch.Generator().manual_seed(params.seed)
        if params.guided is not None:
            req.grammar = self.grammar_compiler().matcher(params.guided)
        self._detok[request_id] = IncrementalDetokenizer(
            self.tokenizer, skip_special_tokens=params.skip_special_tokens, stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output)
        self.scheduler.add(req)
        return req

    def grammar_compiler(self):
        if self._grammar is None:
            from hearth.engine.guided import GrammarCompiler
            self._grammar = GrammarCompiler(self.tokenizer, self.arch.vocab_size)
        return self._grammar

    def abort_request(self, request_id: str) -> None:
        req = self.scheduler.requests.get(request_id)
        if req is not None:
            self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
            self._aborted.append(req)

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0 or bool(self._aborted)

    # ---- stepping -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs = [self._make_output(r, [], "") for r in self._aborted]
        self._aborted = []
        sched = self.scheduler.schedule()
        for req in sched.preempted:
            self.counters["preemptions"] += 1
            if cdiv(req.num_tokens + 1, self.block_size) > self.pool.num_blocks:
                # It can never fit again, even alone: end it rather than loop forever.
                self.scheduler.finish(req, RequestStatus.FINISHED_LENGTH)
                outputs.append(self._finish_output(req))
        if sched.empty:
            return outputs
        sampled = self._execute_isolated(sched, outputs)
        by_req = {s.request.request_id: s for s in sampled}
        for req, num_new in sched.scheduled:
            if req.is_finished:
                continue
            req.num_computed_tokens += num_new
            self.kv.register_computed_blocks(req)
            s = by_req.get(req.request_id)
            if s is not None:
                out = self._process_token(s)
                if out is not None:
                    outputs.append(out)
        return outputs

    def _execute_isolated(self, sched: SchedulerOutput, outputs: list) -> list[SampledToken]:
        try:
            return self.runner.execute(sched)
        except Exception:
            log.exception("batch of %d failed; retrying its requests one by one",
                          len(sched.scheduled))
        sampled = []
        for req, num_new in sched.scheduled:
            try:
                sampled.extend(self.runner.execute(SchedulerOutput([(req, num_new)])))
            except Exception as exc:  # this request alone fails: end it, keep the others
                log.exception("request %s failed", req.request_id)
                req.error = f"{type(exc).__name__}: {exc}"
                self.scheduler.finish(req, RequestStatus.FINISHED_ERROR)
                outputs.append(self._finish_output(req))
        return sampled

    def _process_token(self, s: SampledToken) -> RequestOutput | None:
        req = s.request
        try:
            return self._accept_token(req, s)
        except Exception as exc:
            log.exception("post-processing of %s failed", req.request_id)
            req.error = f"{type(exc).__name__}: {exc}"
            self.scheduler.finish(req, RequestStatus.FINISHED_ERROR)
            return self._finish_output(req)

    def _accept_token(self, req: Request, s: SampledToken) -> RequestOutput:
        token, p = s.token_id, req.params
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
            self.counters["prompt"] += req.num_prompt_tokens
            self.counters["cached"] += max(0, req.num_cached_tokens)
        req.append_token(token)
        self.counters["generation"] += 1
        if s.logprob is not None:
            req.output_logprobs.append(s.logprob)
        detok = self._detok[req.request_id]
        status = None
        text = ""
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            status, req.stop_reason = RequestStatus.FINISHED_STOPPED, (
                token if token in p.stop_token_ids else None)
        else:
            text = detok.push([token])
            if detok.stopped_by is not None:
                status, req.stop_reason = RequestStatus.FINISHED_STOPPED, detok.stopped_by
        if status is None and req.grammar is not None:
            if not req.grammar.accept(token):
                raise RuntimeError(f"grammar rejected token {token}")
            if req.grammar.is_terminated():
                status = RequestStatus.FINISHED_STOPPED
        if status is None and (req.num_output_tokens >= p.max_tokens
                               or req.num_tokens >= self.max_model_len):
            status = RequestStatus.FINISHED_LENGTH
        new_lp = [s.logprob] if s.logprob is not None else []
        if status is None:
            return self._make_output(req, [token], text, new_lp)
        if detok.stopped_by is None:
            text += detok.flush()
        self.scheduler.finish(req, status)
        return self._make_output(req, [token], text, new_lp)

    def _finish_output(self, req: Request) -> RequestOutput:
        text = self._detok[req.request_id].flush() if req.request_id in self._detok else ""
        return self._make_output(req, [], text)

    def _make_output(self, req: Request, tokens: list[int], text: str,
                     logprobs=None) -> RequestOutput:
        finished = req.is_finished
        if finished:
            self._detok.pop(req.request_id, None)
        return RequestOutput(
            request_id=req.request_id, new_token_ids=tokens, new_text=text, finished=finished,
            finish_reason=req.status.value if finished else None,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=max(0, req.num_cached_tokens),
            num_output_tokens=req.num_output_tokens, new_logprobs=logprobs or [],
            stop_reason=req.stop_reason, error=req.error,
        )

    # ---- introspection --------------------------------------------------------------------
    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(
            num_running=len(s.running), num_waiting=len(s.waiting),
            num_free_blocks=self.pool.num_free_blocks, num_total_blocks=self.pool.num_blocks,
            num_prefill_tokens_inflight=s.num_prefill_tokens_inflight(),
            num_decode_tokens_active=s.num_decode_tokens_active(),
            num_prompt_tokens=self.counters["prompt"], num_cached_tokens=self.counters["cached"],
            num_generation_tokens=self.counters["generation"],
            num_preemptions=self.counters["preemptions"], kv_usage=self.kv.usage(),
        )

    def kv_pool_is_whole(self) -> bool:
        self.pool.check_integrity()
        return self.pool.is_whole() and not self.scheduler.running

"""Draft-model proposer: a small model of the same vocabulary proposes k tokens greedily.

The draft model runs in the engine process with its own ModelRunner, KV pool and block tables
(it shares nothing with the target's pool, so the target's prefix cache and PD paths are
untouched). Each request has a shadow `Request` whose tokens follow the real one: before
drafting, the shadow is cut back to the longest common prefix with the request's tokens
(rejected drafts and tokens the draft never saw are recomputed), its uncomputed tokens run as
one chunk, and k - 1 single-token steps follow — all requests batched in each forward.
Greedy drafts are deterministic, so verification's accept-if-equal rule keeps the target's
distribution (hearth/engine/step.py).
"""

from __future__ import annotations

import logging
from dataclasses import replace

from hearth.config import EngineConfig, SpeculativeConfig
from hearth.engine.kv.block_pool import BlockPool
from hearth.engine.kv.cache import KVCacheManager, cdiv
from hearth.engine.request import Request, RequestStatus
from hearth.engine.sampling_params import SamplingParams
from hearth.engine.scheduler import SchedulerOutput
from hearth.engine.step import StepBuilder, to_step_tokens

log = logging.getLogger("hearth.engine")
GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 30)


class DraftModelProposer:
    name = "draft"

    def __init__(self, config: SpeculativeConfig, engine_config: EngineConfig,
                 target_vocab_size: int) -> None:
        from hearth.engine.executor import make_executor
        from hearth.models.loader import load_checkpoint

        checkpoint = load_checkpoint(config.draft_model)
        if checkpoint.arch.vocab_size != target_vocab_size:
            raise ValueError(f"speculative_draft_model: vocabulary of {checkpoint.arch.vocab_size} "
                             f"tokens, the model's is {target_vocab_size}: they must match")
        draft_config = replace(
            engine_config,
            model=replace(engine_config.model, model=config.draft_model),
            cache=replace(engine_config.cache, num_blocks=config.draft_num_blocks,
                          enable_prefix_caching=False),
            parallel=replace(engine_config.parallel, tensor_parallel_size=1,
                             pipeline_parallel_size=1))
        self.runner = make_executor(draft_config, checkpoint)
        self.block_size = draft_config.cache.block_size
        self.kv = KVCacheManager(BlockPool(self.runner.num_blocks, False), self.block_size)
        self.builder = StepBuilder(self.block_size, checkpoint.arch.vocab_size)
        self.max_model_len = checkpoint.arch.max_position_embeddings
        self.shadows: dict[str, Request] = {}
        self.indexes: dict = {}  # (the n-gram proposers' per-request state; none here)

    def propose_many(self, wants: list[tuple[Request, int]]) -> list[list[int]]:
        active: list[tuple[int, Request, int]] = []  # (index in wants, shadow, k)
        for i, (req, k) in enumerate(wants):
            shadow = self._sync(req)
            if shadow is not None and req.num_tokens + k < self.max_model_len:
                active.append((i, shadow, k))
        drafts: list[list[int]] = [[] for _ in wants]
        step = 0
        while active:
            out = SchedulerOutput()
            for _, shadow, k in active:
                num_new = shadow.num_tokens - shadow.num_computed_tokens
                if not self.kv.allocate(shadow, num_new):
                    continue  # the draft pool is full: this request drafts less
                out.scheduled.append((shadow, num_new))
            if not out.scheduled:
                break
            cmd, shadows = self.builder.build(out)
            tokens = to_step_tokens(self.runner.execute(cmd), shadows, cmd.samples)
            by_id = {t.request.request_id: t.token_ids[0] for t in tokens}
            step += 1
            still = []
            for i, shadow, k in active:
                token = by_id.get(shadow.request_id)
                if token is None:
                    continue
                shadow.num_computed_tokens = shadow.num_tokens
                shadow.append_token(token)
                drafts[i].append(token)
                if step < k:
                    still.append((i, shadow, k))
            active = still
        return drafts

    def _sync(self, req: Request) -> Request | None:
        """The request's shadow, cut back to what it shares with the request's tokens."""
        shadow = self.shadows.get(req.request_id)
        tokens = req.all_token_ids
        if shadow is None:
            shadow = Request(req.request_id, tokens[:-1] or tokens[:1], GREEDY)
            shadow.status = RequestStatus.RUNNING
            self.shadows[req.request_id] = shadow
        # Up to `synced` the shadow equals the request (both only grew since); past it sit the
        # drafts of the last step, which the request may or may not have kept.
        have = shadow.all_token_ids
        common = min(getattr(shadow, "synced", 0), len(tokens))
        limit = min(len(have), len(tokens))
        while common < limit and have[common] == tokens[common]:
            common += 1
        shadow.synced = len(tokens)
        shadow.all_token_ids = list(tokens)
        shadow.prompt_token_ids = shadow.all_token_ids[: shadow.num_prompt_tokens]
        shadow.output_token_ids = shadow.all_token_ids[shadow.num_prompt_tokens:]
        shadow.num_computed_tokens = min(shadow.num_computed_tokens, common, len(tokens) - 1)
        keep = cdiv(shadow.num_computed_tokens, self.block_size)
        if len(shadow.block_ids) > keep:  # blocks past the kept tokens go back to the pool
            self.kv.free_block_ids(shadow.block_ids[keep:])
            shadow.block_ids = shadow.block_ids[:keep]
        return shadow

    def drop(self, request_id: str) -> None:
        shadow = self.shadows.pop(request_id, None)
        if shadow is not None:
            self.kv.free(shadow)
            shadow.status = RequestStatus.FINISHED_ABORTED  # the builder forgets its sampler state

    def finished(self, req: Request) -> None:
        self.drop(req.request_id)

    def close(self) -> None:
        for request_id in list(self.shadows):
            self.drop(request_id)
        self.runner.close()

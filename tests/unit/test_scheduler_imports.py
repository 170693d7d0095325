"""Scheduler with decode-side KV imports: exact block ids, no budget used, aborts deferred."""

from hearth.config import SchedulerConfig
from hearth.engine.kv.block_pool import BlockPool
from hearth.engine.kv.cache import KVCacheManager
from hearth.engine.request import Request, RequestStatus
from hearth.engine.sampling_params import SamplingParams
from hearth.engine.scheduler import Scheduler

BS = 4


def make_scheduler(num_blocks=16, budget=8) -> Scheduler:
    kv = KVCacheManager(BlockPool(num_blocks), BS)
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8), kv,
                     max_model_len=1024)


def make_import(rid: str, num_prompt: int, first_token: int = 999) -> Request:
    """A decode-hop request: prompt + the first token, KV to be imported."""
    req = Request(rid, list(range(num_prompt)), SamplingParams(max_tokens=8))
    req.append_token(first_token)
    req.kv_import = object()  # the connector's handle; the scheduler only tests it for None
    return req


def test_import_is_parked_with_blocks_for_the_prompt_only():
    s = make_scheduler()
    s.add(make_import("d", 10))  # 10 prompt tokens: 3 blocks, the last partial
    out = s.schedule()
    assert out.scheduled == [] and out.num_batched_tokens == 0
    assert [r.request_id for r in out.kv_imports] == ["d"]
    req = s.importing[0]
    assert req.status == RequestStatus.WAITING_FOR_KV and req.block_ids == [0, 1, 2]
    assert s.num_prefill_tokens_inflight() == 0 and s.num_unfinished == 1
    assert s.schedule().kv_imports == []  # parked: never scheduled twice
    s.complete_import(req, num_computed_tokens=10)
    assert req.status == RequestStatus.RUNNING and req.kv_import is None
    out = s.schedule()
    assert [(r.request_id, n) for r, n in out.scheduled] == [("d", 1)]  # the first token's KV
    assert req.block_ids == [0, 1, 2]


def test_import_adopts_local_prefix_hits_first():
    s = make_scheduler()
    warm = Request("w", list(range(9)), SamplingParams(max_tokens=8))
    s.add(warm)
    out = s.schedule()
    warm.num_computed_tokens = 9
    s.kv.register_computed_blocks(warm)  # blocks 0, 1 cached (tokens 0..7)
    s.finish(warm, RequestStatus.FINISHED_LENGTH)
    s.add(make_import("d", 10))
    out = s.schedule()
    req = out.kv_imports[0]
    assert req.block_ids[:2] == [0, 1] and len(req.block_ids) == 3
    assert req.num_computed_tokens == 8 and req.num_cached_tokens == 8
    s.complete_import(req, num_computed_tokens=10)
    s.finish(req, RequestStatus.FINISHED_LENGTH)
    # a prompt whose every block is cached locally still parks (to acknowledge), pulling nothing
    s.add(make_import("e", 8))
    req = s.schedule().kv_imports[0]
    assert req.block_ids == [0, 1] and req.num_computed_tokens == 8


def test_abort_during_import_frees_blocks_only_when_the_transfer_ends():
    s = make_scheduler()
    s.add(make_import("d", 10))
    req = s.schedule().kv_imports[0]
    free_before = s.kv.num_free_blocks
    s.finish(req, RequestStatus.FINISHED_ABORTED)
    assert s.kv.num_free_blocks == free_before and req.block_ids == [0, 1, 2]
    assert "d" not in s.requests
    s.complete_import(req, num_computed_tokens=10)
    assert s.kv.pool.is_whole() and not s.running and not s.importing


def test_failed_import_recomputes_from_the_local_hits():
    s = make_scheduler(budget=16)
    s.add(make_import("d", 10))
    req = s.schedule().kv_imports[0]
    s.complete_import(req, num_computed_tokens=0)  # nothing usable arrived
    out = s.schedule()
    assert [(r.request_id, n) for r, n in out.scheduled] == [("d", 11)]  # prompt + first token

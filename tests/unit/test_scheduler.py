"""Scheduler: token budget, chunked prefill next to decodes, prefix hits, preemption."""

from hearth.config import SchedulerConfig
from hearth.engine.kv.block_pool import BlockPool
from hearth.engine.kv.cache import KVCacheManager
from hearth.engine.request import Request, RequestStatus
from hearth.engine.sampling_params import SamplingParams
from hearth.engine.scheduler import Scheduler

BS = 4


def make_scheduler(num_blocks=32, budget=16, max_seqs=8) -> Scheduler:
    kv = KVCacheManager(BlockPool(num_blocks), BS)
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs), kv,
                     max_model_len=1024)


def make_request(rid, n, start=0):
    return Request(rid, list(range(start, start + n)), SamplingParams(max_tokens=8))


def advance(sched: Scheduler, out, sample=True):
    """What the engine does after the runner (through the same `Scheduler.commit`): a request
    whose computed tokens reach its end gets a sampled token."""
    for req, num_new in out.scheduled:
        samples = sample and req.num_computed_tokens + num_new == req.num_tokens
        sched.commit(req, num_new, [999] if samples else [], 0)


def grants(out):
    return [(r.request_id, n) for r, n in out.scheduled]


def test_long_prompt_is_chunked_while_decode_keeps_running():
    s = make_scheduler(budget=16)
    s.add(make_request("short", 5))
    out = s.schedule()
    assert grants(out) == [("short", 5)]
    advance(s, out)
    s.add(make_request("long", 40, start=100))
    out = s.schedule()
    assert grants(out) == [("short", 1), ("long", 15)]
    advance(s, out)
    out = s.schedule()
    assert grants(out) == [("short", 1), ("long", 15)]
    advance(s, out)
    out = s.schedule()
    assert grants(out) == [("short", 1), ("long", 10)]
    advance(s, out)
    out = s.schedule()
    assert grants(out) == [("short", 1), ("long", 1)]


def test_max_num_seqs_caps_running():
    s = make_scheduler(max_seqs=2, budget=100)
    for i in range(3):
        s.add(make_request(str(i), 3, start=10 * i))
    out = s.schedule()
    assert grants(out) == [("0", 3), ("1", 3)]
    assert [r.request_id for r in s.waiting] == ["2"]


def test_prefix_hit_counts_as_computed():
    s = make_scheduler(budget=64)
    a = make_request("a", 10)
    s.add(a)
    advance(s, s.schedule())
    s.finish(a, RequestStatus.FINISHED_STOPPED)
    b = make_request("b", 12)  # shares tokens 0..9 with a; blocks 0,1 (8 tokens) are cached
    s.add(b)
    out = s.schedule()
    assert grants(out) == [("b", 4)]
    assert b.num_cached_tokens == 8 and b.num_computed_tokens == 8


def test_preemption_frees_newest_and_requeues_it_first():
    s = make_scheduler(num_blocks=4, budget=64)
    a, b = make_request("a", 7), make_request("b", 7, start=50)
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert grants(out) == [("a", 7), ("b", 7)]  # 2 blocks each, pool full
    advance(s, out)
    # a now has 8 tokens (needs no new block for its 8th), b too; then both need a third block
    out = s.schedule()
    assert grants(out) == [("a", 1), ("b", 1)]
    advance(s, out)
    out = s.schedule()  # a needs block 3 of 3: b is preempted to make room
    assert [r.request_id for r in out.preempted] == ["b"]
    assert grants(out) == [("a", 1)]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and not b.block_ids
    assert s.waiting[0] is b
    s.finish(a, RequestStatus.FINISHED_STOPPED)
    out = s.schedule()
    # a took b's tail block (freed first, so evicted first); b's head block is still cached
    assert grants(out) == [("b", 9 - 4)]
    assert b.num_computed_tokens == 4
    s.kv.pool.check_integrity()


def test_abort_waiting_and_running_frees_everything():
    s = make_scheduler(num_blocks=8, budget=8)
    a, b = make_request("a", 20), make_request("b", 4, start=40)
    s.add(a)
    s.add(b)
    s.schedule()
    s.finish(a, RequestStatus.FINISHED_ABORTED)
    s.finish(b, RequestStatus.FINISHED_ABORTED)
    assert s.num_unfinished == 0
    assert s.kv.pool.is_whole()
    s.kv.pool.check_integrity()


def test_a_step_with_prompt_tokens_grants_no_drafts():
    """Drafts are verified in pure decode steps only: a step that computes a new prompt (or the
    next chunk of one) leaves them out, with the budget they would have taken."""
    s = make_scheduler(budget=16)
    s.add(make_request("dec", 5))
    advance(s, s.schedule())
    dec = s.requests["dec"]
    dec.spec_token_ids = [7, 8, 9]
    out = s.schedule()  # decoding alone: its drafts ride along
    assert grants(out) == [("dec", 1)] and out.drafts == {"dec": [7, 8, 9]}
    assert out.num_batched_tokens == 4
    s.commit(dec, 1, [999], 3)  # no draft accepted: it goes on with the sampled token
    s.add(make_request("new", 30, start=100))
    out = s.schedule()  # a prompt chunk in the step: no drafts, the budget goes to the prompt
    assert grants(out) == [("dec", 1), ("new", 15)] and out.drafts == {}
    assert out.num_batched_tokens == 16
    advance(s, out)
    out = s.schedule()  # the prompt's last chunk: still none
    assert grants(out) == [("dec", 1), ("new", 15)] and out.drafts == {}
    advance(s, out)
    out = s.schedule()  # both decoding: drafts again
    assert grants(out) == [("dec", 1), ("new", 1)] and out.drafts == {"dec": [7, 8, 9]}

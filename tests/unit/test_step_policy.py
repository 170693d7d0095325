"""Step policy: the prompt budget beside decodes, a cached next turn ahead of cold prompts with
bounded bypass, the cost model; and the scheduler keeping them (exact grants, blocks released)."""

import pytest

from hearth.config import SchedulerConfig
from hearth.engine.kv.block_pool import BlockPool
from hearth.engine.kv.cache import KVCacheManager
from hearth.engine.request import Request, RequestStatus, ttft_breakdown
from hearth.engine.sampling_params import SamplingParams
from hearth.engine.scheduler import Scheduler, is_decoding
from hearth.engine.step_policy import (DRAFT_MARGIN, MIN_PROMPT_TOKENS, WARM_TURN_MAX_TOKENS,
                                       StepCost, WaitingView, draft_break_even, is_warm,
                                       pick_next_waiting, prompt_allowance,
                                       prompt_token_budget)

BS = 4


def make_scheduler(num_blocks=512, budget=512, max_seqs=8, cap=0, bypass=8,
                   cost=None, target_ms=0.0) -> Scheduler:
    kv = KVCacheManager(BlockPool(num_blocks), BS)
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                             max_prompt_tokens_while_decoding=cap, itl_target_ms=target_ms,
                             next_turn_max_bypass=bypass)
    return Scheduler(config, kv, max_model_len=4096, cost=cost)


def make_request(rid, n, start=0, max_tokens=64):
    return Request(rid, list(range(start, start + n)), SamplingParams(max_tokens=max_tokens))


def advance(sched: Scheduler, out):
    """The engine's part after the runner: a request whose computed tokens reach its end gets a
    sampled token."""
    for req, num_new in out.scheduled:
        samples = req.num_computed_tokens + num_new == req.num_tokens
        sched.commit(req, num_new, [999] if samples else [], 0)


def grants(out):
    return [(r.request_id, n) for r, n in out.scheduled]


# ---- the cost model and the pure policy -------------------------------------------------------

def test_cost_model_fits_prompt_tokens_into_the_target_from_medians():
    cost = StepCost(prior_prompt_tokens=300)
    assert cost.prompt_tokens_within(5 / 128) == 300  # nothing measured: the prior
    for _ in range(3):
        cost.observe(0, 0, 1 / 128)  # pure decode steps
    cost.observe(0, 5, 0.5)  # a verify step (drafts) is no decode sample
    cost.observe(10, 0, 1.0)  # too few prompt tokens to price them
    cost.observe(256, 0, 1 / 128 + 256 / 4096)
    cost.observe(512, 0, 1 / 128 + 512 / 4096)
    assert cost.prompt_tokens_within(5 / 128) == 300  # two prompt samples: still the prior
    cost.observe(128, 0, 1 / 128 + 128 / 4096)
    assert cost.decode_step_seconds() == 1 / 128
    # (5/128 - 1/128) s of room at 1/4096 s per prompt token
    assert cost.prompt_tokens_within(5 / 128) == 128
    cost.observe(0, 0, 5.0)  # one stalled step moves no median
    assert cost.prompt_tokens_within(5 / 128) == 128
    assert cost.prompt_tokens_within(1 / 256) == 0  # the decodes alone overrun the target


def test_prompt_budget_is_whole_without_decodes_and_bounded_with_them():
    def config(cap=0, target=0.0, budget=2048):
        return SchedulerConfig(max_num_batched_tokens=budget,
                               max_prompt_tokens_while_decoding=cap, itl_target_ms=target)

    prior = StepCost(prior_prompt_tokens=300)
    assert prompt_token_budget(config(target=40), prior, num_decoding=0) == 2048
    assert prompt_token_budget(config(target=40), prior, num_decoding=3) == 300
    assert prompt_token_budget(config(cap=100, target=40), prior, 3) == 100  # the smaller bound
    assert prompt_token_budget(config(cap=500), prior, 3) == 500  # no target: the cap alone
    assert prompt_token_budget(config(), prior, 3) == 2048  # neither: today's whole budget
    assert prompt_token_budget(config(target=40), None, 3) == 2048  # no cost model
    tiny = StepCost(prior_prompt_tokens=3)
    assert prompt_token_budget(config(target=40), tiny, 1) == MIN_PROMPT_TOKENS  # prompts progress
    slow = StepCost(prior_prompt_tokens=300)
    for _ in range(3):
        slow.observe(0, 0, 0.3)  # decodes alone take 300 ms: a 40 ms target is out of reach
    assert prompt_token_budget(config(target=40), slow, 32) == 2048
    assert prompt_token_budget(config(cap=100, target=40), slow, 32) == 100  # the cap still holds
    grown = StepCost(prior_prompt_tokens=300)  # a decode median of 1-row steps, then 32 rows
    for rows in (1, 1, 1, 2, 4):
        grown.observe(0, 0, 0.005 + 0.01 * rows, num_decode_rows=rows)
    assert grown.decode_step_seconds() < 0.04 and grown.decode_rows_seconds(32) > 0.3
    assert prompt_token_budget(config(target=40), grown, 32) == 2048  # the line, not the median
    assert prompt_token_budget(config(target=40, budget=32), tiny, 1) == 32  # never above the budget


def test_negative_policy_settings_are_refused_naming_the_field():
    for name in ("max_prompt_tokens_while_decoding", "itl_target_ms", "next_turn_max_bypass"):
        with pytest.raises(ValueError, match=name):
            SchedulerConfig(**{name: -1})


def test_a_warm_turn_is_picked_unless_one_ahead_was_passed_enough():
    cold, warm = WaitingView(False, 0), WaitingView(True, 0)
    assert pick_next_waiting([cold, cold, warm], max_bypass=2) == 2
    assert pick_next_waiting([warm, warm], max_bypass=2) == 0
    assert pick_next_waiting([cold, cold], max_bypass=2) == 0
    assert pick_next_waiting([WaitingView(False, 1), warm], max_bypass=2) == 1
    assert pick_next_waiting([WaitingView(False, 2), warm], max_bypass=2) == 0  # its turn now
    assert pick_next_waiting([cold, WaitingView(False, 2), warm], max_bypass=2) == 0
    assert pick_next_waiting([cold, warm], max_bypass=0) == 0  # 0: first come, first served
    assert is_warm(40, 49) and is_warm(8, 16) and not is_warm(8, 17) and not is_warm(0, 1)


def test_ttft_breakdown_adds_up_to_arrival_to_first_token():
    req = make_request("r", 8)
    assert ttft_breakdown(req) is None  # no first token yet
    req.arrival_time, req.first_scheduled_time = 10.0, 10.5
    req.first_step_start, req.first_token_time = 12.0, 12.25
    assert ttft_breakdown(req) == (0.5, 1.5, 0.25)
    req.first_step_start = 10.4  # admitted in its first-token step, stamped just after its start
    assert ttft_breakdown(req) == (0.5, 0.0, 1.75)


# ---- the scheduler under the policy -----------------------------------------------------------

def test_prompt_tokens_stay_within_the_budget_and_every_decode_runs_each_step():
    s = make_scheduler(budget=512, cap=64)
    for i in range(3):
        s.add(make_request(f"d{i}", 5, start=100 * i, max_tokens=64))
    advance(s, s.schedule())
    s.add(make_request("long1", 300, start=1000))
    s.add(make_request("long2", 200, start=2000))
    prompt_steps = 0
    for _ in range(20):
        decoding = {r.request_id for r in s.running if is_decoding(r)}
        out = s.schedule()
        granted = dict(grants(out))
        assert decoding <= granted.keys()  # no decode row waits behind a prompt chunk
        prompt_tokens = sum(n for r, n in out.scheduled if r.request_id not in decoding)
        assert prompt_tokens == out.num_prompt_tokens <= 64
        prompt_steps += prompt_tokens > 0
        advance(s, out)
    assert all(is_decoding(s.requests[rid]) for rid in ("long1", "long2"))
    assert prompt_steps == 8  # 500 prompt tokens in steps of 64: no step left idle of prompts
    s.kv.pool.check_integrity()


def test_decodes_are_granted_before_an_older_running_prompt_chunk():
    s = make_scheduler(budget=128)
    dec = Request("dec", list(range(500, 510)), SamplingParams(max_tokens=8))
    dec.append_token(999)  # a decode hop: prompt + first token, its KV imported
    dec.kv_import = object()
    s.add(dec)
    long = make_request("long", 300)
    s.add(long)
    out = s.schedule()
    assert grants(out) == [("long", 128)] and out.kv_imports == [dec]
    advance(s, out)
    s.complete_import(dec, num_computed_tokens=10)
    assert [r.request_id for r in s.running] == ["long", "dec"]  # the chunk is older
    out = s.schedule()
    assert grants(out) == [("dec", 1), ("long", 127)]
    assert out.num_prompt_tokens == 127 and out.num_batched_tokens == 128


def test_a_prompt_chunk_never_preempts_a_request_granted_in_the_same_step():
    # 36 blocks: long's first chunk takes 32, dec's import 3; long's next chunk needs 32 more.
    s = make_scheduler(num_blocks=36, budget=128)
    dec = Request("dec", list(range(500, 510)), SamplingParams(max_tokens=8))
    dec.append_token(999)
    dec.kv_import = object()
    s.add(dec)
    long = make_request("long", 300)
    s.add(long)
    advance(s, s.schedule())
    s.complete_import(dec, num_computed_tokens=10)
    out = s.schedule()
    assert grants(out) == [("dec", 1)] and out.preempted == []  # long waits, keeps its blocks
    assert long.status == RequestStatus.RUNNING and len(long.block_ids) == 32
    s.kv.pool.check_integrity()
    s.finish(long, RequestStatus.FINISHED_ABORTED)
    s.finish(dec, RequestStatus.FINISHED_ABORTED)
    assert s.num_unfinished == 0 and s.kv.pool.is_whole()
    s.kv.pool.check_integrity()


def cached_session(s: Scheduler, n: int = 40) -> Request:
    """A first turn of `n` prompt tokens, computed and finished: its blocks stay cached."""
    first = make_request("turn1", n, start=0, max_tokens=1)
    s.add(first)
    advance(s, s.schedule())
    s.finish(first, RequestStatus.FINISHED_STOPPED)
    return first


def next_turn(first: Request, rid: str, num_new: int = 8, seed: int = 3000) -> Request:
    """The session's next turn: its history, then `num_new` tokens of its own."""
    ids = first.all_token_ids + list(range(seed, seed + num_new))
    return Request(rid, ids, SamplingParams(max_tokens=8))


def test_a_cached_next_turn_is_admitted_before_cold_prompts():
    s = make_scheduler(max_seqs=2, bypass=8)
    first = cached_session(s)
    busy = make_request("busy", 5, start=9000)  # holds one seat
    s.add(busy)
    advance(s, s.schedule())
    cold1, cold2 = make_request("cold1", 80, start=1000), make_request("cold2", 80, start=2000)
    turn = next_turn(first, "turn2")
    for req in (cold1, cold2, turn):
        s.add(req)
    out = s.schedule()
    # 49 tokens, 40 of them cached (10 blocks): only its 9 new ones are computed
    assert grants(out) == [("busy", 1), ("turn2", 9)]
    assert turn.num_cached_tokens == 40
    assert [r.request_id for r in s.waiting] == ["cold1", "cold2"]
    assert cold1.num_bypassed == cold2.num_bypassed == 1
    # FIFO when bypass is off
    s2 = make_scheduler(max_seqs=2, bypass=0)
    first = cached_session(s2)
    s2.add(make_request("busy", 5, start=9000))
    advance(s2, s2.schedule())
    for req in (make_request("cold1", 80, start=1000), next_turn(first, "turn2")):
        s2.add(req)
    assert grants(s2.schedule()) == [("busy", 1), ("cold1", 80)]


def test_a_cold_prompt_is_passed_at_most_max_bypass_times():
    s = make_scheduler(max_seqs=1, bypass=2)
    first = cached_session(s)
    cold = make_request("cold", 80, start=1000)
    s.add(cold)
    admitted = []
    for k in range(4):
        s.add(next_turn(first, f"turn{k}", seed=3000 + 100 * k))
        out = s.schedule()
        (req, _), = out.scheduled
        admitted.append(req.request_id)
        s.finish(req, RequestStatus.FINISHED_STOPPED)  # its seat is free again
    assert admitted == ["turn0", "turn1", "cold", "turn2"]
    assert cold.num_bypassed == 2
    assert s.num_unfinished == 1 and [r.request_id for r in s.waiting] == ["turn3"]
    s.finish(s.waiting[0], RequestStatus.FINISHED_ABORTED)
    assert s.num_unfinished == 0 and s.kv.pool.is_whole()
    s.kv.pool.check_integrity()


def test_aborting_a_passed_request_and_a_preempted_turn_releases_everything():
    # 20 blocks: the session's 10 cached, then a turn and a decode compete for the rest.
    s = make_scheduler(num_blocks=20, max_seqs=4, bypass=8)
    first = cached_session(s)
    cold = make_request("cold", 200, start=1000)  # 50 blocks: never fits, stays queued
    turn = next_turn(first, "turn2", num_new=20)
    s.add(cold)
    s.add(turn)
    out = s.schedule()
    assert grants(out) == [("turn2", 21)] and cold.num_bypassed == 1
    dec = make_request("dec", 14, start=5000)
    s.add(dec)
    advance(s, out)
    while not any(turn is r for r in s.waiting):  # grow until the pool runs short
        advance(s, s.schedule())
    assert turn.status == RequestStatus.PREEMPTED and turn.num_preemptions == 1
    for req in (cold, turn, dec):
        s.finish(req, RequestStatus.FINISHED_ABORTED)
    assert s.num_unfinished == 0 and s.kv.pool.is_whole()
    s.kv.pool.check_integrity()


def test_a_warm_turn_passes_the_prompt_bound_in_one_step_and_a_cold_prompt_does_not():
    """Beside decodes the step's prompt bound is 64: a session's next turn (most of it cached)
    still computes all its new tokens in one step, a cold prompt only 64 per step; the exemption
    stops at WARM_TURN_MAX_TOKENS."""
    s = make_scheduler(budget=2048, cap=64)
    first = cached_session(s, n=400)
    busy = make_request("busy", 5, start=9000)
    s.add(busy)
    advance(s, s.schedule())
    cold, turn = make_request("cold", 300, start=1000), next_turn(first, "turn2", num_new=200)
    other = next_turn(first, "other", num_new=150, seed=7000)
    for req in (cold, turn, other):
        s.add(req)
    out = s.schedule()
    # one warm turn whole (+ turn 1's output token), which spends the step's bound too
    assert grants(out) == [("busy", 1), ("turn2", 201)] and turn.warm_turn
    advance(s, out)
    out = s.schedule()  # the next step's exemption goes to the other warm turn
    assert grants(out) == [("busy", 1), ("turn2", 1), ("other", 151)]
    assert other.warm_turn and not cold.warm_turn
    advance(s, out)
    out = s.schedule()  # no warm turn left: the cold prompt's chunks, 64 at a time
    assert grants(out) == [("busy", 1), ("turn2", 1), ("other", 1), ("cold", 64)]
    advance(s, out)
    s.finish(other, RequestStatus.FINISHED_ABORTED)
    long = next_turn(first, "turn3", num_new=WARM_TURN_MAX_TOKENS + 4, seed=5000)
    s.add(long)
    s.finish(cold, RequestStatus.FINISHED_ABORTED)
    out = s.schedule()
    assert ("turn3", 64) in grants(out)  # too many new tokens to count as a short next turn
    assert prompt_allowance(10, 300, warm=True) == 300 and prompt_allowance(10, 300, False) == 10
    assert prompt_allowance(-5, 3, warm=False) == 0
    for req in list(s.running):
        s.finish(req, RequestStatus.FINISHED_ABORTED)
    assert s.num_unfinished == 0 and s.kv.pool.is_whole()
    s.kv.pool.check_integrity()


def test_draft_break_even_from_the_measured_row_cost():
    """A step's seconds fitted as fixed + per-row; a draft token must bring per_row*n / step
    accepted tokens; the last fit holds while the rows stop varying; no line, no bound."""
    cost = StepCost(prior_prompt_tokens=256)
    assert draft_break_even(cost, 8) == 0.0 and draft_break_even(None, 8) == 0.0
    for rows in (8, 16, 24, 8, 40):
        cost.observe(0, rows - 8, 0.010 + 0.005 * rows, num_decode_rows=8)
    cost.observe(300, 0, 5.0, num_decode_rows=8)  # a prompt step is no row sample
    fixed, per_row = cost.row_cost()
    assert fixed == pytest.approx(0.010) and per_row == pytest.approx(0.005)
    assert draft_break_even(cost, 8) == 1.0  # compute-bound: 1.25 * 0.8, at most 1
    assert draft_break_even(cost, 1) == pytest.approx(DRAFT_MARGIN * 0.005 / 0.015)
    for _ in range(2 * 16):
        cost.observe(0, 0, 0.05, num_decode_rows=8)  # nobody drafts any more: rows fixed
    assert cost.row_cost() == pytest.approx((0.010, 0.005))
    early = StepCost(prior_prompt_tokens=256)  # no line yet: a prompt token prices a row
    for _ in range(3):
        early.observe(0, 0, 0.05, num_decode_rows=8)
        early.observe(100, 0, 0.05 + 100 * 0.002, num_decode_rows=8)
    assert early.row_cost() is None
    assert draft_break_even(early, 8) == pytest.approx(DRAFT_MARGIN * 0.016 / 0.05)


def test_draft_length_follows_acceptance_against_the_break_even():
    from hearth.engine.speculative.speculator import worth_drafting

    assert worth_drafting(1.0, 0.8, limit=8) == 2 and worth_drafting(1.0, 1.0) == 0  # as 0.9
    assert worth_drafting(0.9, 0.8) == 2  # 0.9, 0.81 > 0.8; 0.729 not
    assert worth_drafting(1.0, 0.05, limit=8) == 8  # cheap rows: the whole draft
    assert worth_drafting(0.5, 0.1) == 3 and worth_drafting(0.5, 0.6) == 0
    assert worth_drafting(0.99, 0.0, limit=5) == 5

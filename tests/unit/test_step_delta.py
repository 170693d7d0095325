"""The step protocol's deltas: a StepCommand carries each request's slot and only the blocks (and
penalty history) the executor lacks; `StepReceiver` rebuilds tables equal to the full ones every
step, through growth, prefix hits, preemption, finish, re-add and failed steps, and a divergence
raises instead of attending over wrong blocks."""

import msgspec
import pytest

from hearth.config import SchedulerConfig
from hearth.engine.kv.block_pool import BlockPool
from hearth.engine.kv.cache import KVCacheManager, cdiv
from hearth.engine.request import Request, RequestStatus
from hearth.engine.sampling_params import SamplingParams
from hearth.engine.scheduler import Scheduler, SchedulerOutput
from hearth.engine.step import SampleRow, StepBuilder, StepCommand, make_sample_row
from hearth.engine.step_state import StepProtocolError, StepReceiver

BS = 4
VOCAB = 64
PENALISED = SamplingParams(max_tokens=1000, repetition_penalty=1.3, presence_penalty=0.2)
wire = msgspec.msgpack.Encoder().encode
unwire = msgspec.msgpack.Decoder(StepCommand).decode


def full_tables(cmd: StepCommand, out: SchedulerOutput) -> list[list[int]]:
    """What the builder sent before deltas: each request's first cdiv(context, BS) blocks."""
    return [req.block_ids[: cdiv(c, BS)] for (req, _), c in zip(out.scheduled, cmd.context_lens)]


def step(builder: StepBuilder, receiver: StepReceiver, out: SchedulerOutput) -> StepCommand:
    """Build, cross the wire, receive; the rebuilt tables and histories must be the full ones."""
    cmd = unwire(wire(builder.build(out)[0]))
    got = receiver.receive(cmd)
    assert got.block_tables == full_tables(cmd, out)
    for row in got.samples:
        req = out.scheduled[row.index][0]
        want = make_sample_row(req, row.index, VOCAB)  # whole history, as before deltas
        assert (row.prompt_ids, row.output_ids) == (want.prompt_ids, want.output_ids)
    return cmd


def commit_all(sched: Scheduler, out: SchedulerOutput, token: int = 7) -> None:
    for req, num_new in out.scheduled:
        samples = req.num_computed_tokens + num_new >= req.num_tokens
        sched.commit(req, num_new, [token] if samples else [], 0)


def make_scheduler(num_blocks: int, budget: int = 64) -> Scheduler:
    kv = KVCacheManager(BlockPool(num_blocks), BS)
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8), kv, 4096)


def test_decode_steps_send_only_new_blocks_and_finished_slots_are_freed_and_reused():
    sched = make_scheduler(32)
    builder, receiver = StepBuilder(BS, VOCAB), StepReceiver(BS)
    a, b = Request("a", list(range(6)), SamplingParams()), Request("b", [9] * 3, SamplingParams())
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    cmd = step(builder, receiver, out)
    assert (cmd.slots, cmd.num_known_blocks, cmd.new_block_ids) == ([0, 1], [0, 0], [[0, 1], [2]])
    commit_all(sched, out)  # a: 7 tokens, b: 4 tokens
    out = sched.schedule()
    cmd = step(builder, receiver, out)  # a's 7th token fits block 1; b's 4th fits block 2
    assert (cmd.num_known_blocks, cmd.new_block_ids, cmd.freed_slots) == ([2, 1], [[], []], [])
    commit_all(sched, out)  # a: 8, b: 5 tokens
    out = sched.schedule()
    cmd = step(builder, receiver, out)  # a's 8th fits; b's 5th needs a block
    assert (cmd.num_known_blocks, cmd.new_block_ids) == ([2, 1], [[], [3]])
    commit_all(sched, out)
    sched.finish(a, RequestStatus.FINISHED_STOPPED)
    c = Request("c", [5] * 2, SamplingParams())
    sched.add(c)
    out = sched.schedule()
    cmd = step(builder, receiver, out)  # a's slot is announced freed and handed to c, whole
    assert (cmd.slots, cmd.num_known_blocks, cmd.freed_slots) == ([1, 0], [2, 0], [0])
    assert sorted(receiver.slots) == [0, 1]


def test_random_run_with_preemption_prefix_hits_penalties_and_readds_equals_full_tables():
    """A tight pool preempts; shared prompts hit the prefix cache; finished ids come back."""
    import random

    rng = random.Random(0)
    sched = make_scheduler(24, budget=24)
    builder, receiver = StepBuilder(BS, VOCAB), StepReceiver(BS)
    made = 0
    seen = {"preempted": 0, "resent": 0, "delta": 0, "freed": 0}
    for _ in range(300):
        while sched.num_unfinished < 5:
            params = PENALISED if made % 2 else SamplingParams(max_tokens=1000)
            prompt = [1, 2, 3, 4, 5, 6, 7, 8] + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 12))]
            rid = next(f"r{i}" for i in range(7) if f"r{i}" not in sched.requests)
            sched.add(Request(rid, prompt, params))  # ids come back once finished
            made += 1
        out = sched.schedule()
        seen["preempted"] += len(out.preempted)
        if out.empty:
            continue
        cmd = step(builder, receiver, out)
        seen["freed"] += len(cmd.freed_slots)
        for (req, _), known in zip(out.scheduled, cmd.num_known_blocks):
            seen["resent" if known == 0 and req.num_preemptions else "delta"] += 1
        commit_all(sched, out, rng.randrange(VOCAB))
        for req in list(sched.running):
            if req.num_output_tokens >= rng.randrange(3, 40):
                sched.finish(req, RequestStatus.FINISHED_LENGTH)
        assert set(receiver.slots) == {e.slot for e in builder.sent.entries.values()}
    assert all(n > 0 for n in seen.values()), seen


def test_preempted_request_is_resent_whole_when_it_resumes():
    sched = make_scheduler(4, budget=32)
    builder, receiver = StepBuilder(BS, VOCAB), StepReceiver(BS)
    old, new = Request("old", [1] * 7, SamplingParams()), Request("new", [2] * 7, SamplingParams())
    sched.add(old)
    sched.add(new)
    out = sched.schedule()
    cmd = step(builder, receiver, out)
    assert cmd.new_block_ids == [[0, 1], [2, 3]]
    commit_all(sched, out)  # 8 tokens each: both fit their 2 blocks
    commit = sched.schedule()
    step(builder, receiver, commit)
    commit_all(sched, commit)  # 9 tokens each: the next step needs a third block each
    out = sched.schedule()
    assert out.preempted == [new]
    cmd = step(builder, receiver, out)
    assert (cmd.slots, cmd.num_known_blocks, cmd.freed_slots) == ([0], [2], [1])
    commit_all(sched, out)
    sched.finish(old, RequestStatus.FINISHED_STOPPED)
    out = sched.schedule()
    assert [r for r, _ in out.scheduled] == [new]
    cmd = step(builder, receiver, out)  # blocks re-allocated: the whole table, a fresh slot
    assert (cmd.slots, cmd.num_known_blocks, cmd.freed_slots) == ([0], [0], [0])
    assert cmd.new_block_ids[0] == new.block_ids


def test_penalty_history_is_sent_once_then_only_the_new_output_tokens():
    builder, receiver = StepBuilder(BS, VOCAB), StepReceiver(BS)
    req = Request("p", [3, 4, 5], PENALISED)
    req.status, req.block_ids = RequestStatus.RUNNING, [0, 1]
    rows = []
    for token in (11, 12, 13):
        req.num_computed_tokens = req.num_tokens - 1
        out = SchedulerOutput([(req, 1)])
        cmd = step(builder, receiver, out)
        rows.append((cmd.samples[0].prompt_ids, cmd.samples[0].output_ids,
                     cmd.samples[0].output_start))
        req.append_token(token)
    assert rows == [([3, 4, 5], [], 0), ([3, 4, 5], [11], 0), ([], [12], 1)]


def test_a_table_that_changed_other_than_by_appending_is_resent_whole():
    """The draft model's shadows are cut back and regrow (their blocks freed and taken again)."""
    builder, receiver = StepBuilder(BS, VOCAB), StepReceiver(BS)
    req = Request("s", list(range(10)), SamplingParams())
    req.status, req.block_ids, req.num_computed_tokens = RequestStatus.RUNNING, [4, 5, 6], 9
    out = SchedulerOutput([(req, 1)])
    step(builder, receiver, out)
    req.block_ids = [4, 5, 9]  # the last block replaced
    cmd = step(builder, receiver, out)
    assert (cmd.num_known_blocks, cmd.new_block_ids) == ([0], [[4, 5, 9]])
    req.block_ids = [4, 5, 9]  # a new list, the same ids: nothing to send
    cmd = step(builder, receiver, out)
    assert (cmd.num_known_blocks, cmd.new_block_ids) == ([3], [[]])


def test_a_failed_step_is_resent_whole_and_a_missed_one_is_an_error():
    builder, receiver = StepBuilder(BS, VOCAB), StepReceiver(BS)
    req = Request("f", list(range(7)), SamplingParams())
    req.status, req.block_ids, req.num_computed_tokens = RequestStatus.RUNNING, [0, 1], 6
    out = SchedulerOutput([(req, 1)])
    step(builder, receiver, out)
    req.num_computed_tokens, req.block_ids = 8, [0, 1, 2]
    req.all_token_ids += [1, 1]
    builder.build(out)  # the executor raised before applying it ...
    builder.step_failed()  # ... and the engine said so
    cmd = step(builder, receiver, out)
    assert (cmd.num_known_blocks, cmd.new_block_ids) == ([0], [[0, 1, 2]])
    req.num_computed_tokens, req.block_ids = 12, [0, 1, 2, 3]
    req.all_token_ids += [1] * 4
    builder.build(out)  # lost without a word: the next command's length check fails
    with pytest.raises(StepProtocolError, match="assumes 4 blocks held, this executor has 3"):
        receiver.receive(builder.build(out)[0])


def test_tampered_tables_fail_the_checksum():
    builder, receiver = StepBuilder(BS, VOCAB), StepReceiver(BS)
    req = Request("t", list(range(5)), SamplingParams())
    req.status, req.block_ids, req.num_computed_tokens = RequestStatus.RUNNING, [3, 8], 4
    cmd = builder.build(SchedulerOutput([(req, 1)]))[0]
    with pytest.raises(StepProtocolError, match="checksum"):
        receiver.receive(msgspec.structs.replace(cmd, new_block_ids=[[8, 3]]))


def test_a_build_that_raises_changes_nothing():
    class BrokenGrammar:
        def is_terminated(self):
            return False

        def fill_mask(self, row):
            raise ValueError("no mask")

        def rollback(self, n):
            pass

    builder, receiver = StepBuilder(BS, VOCAB), StepReceiver(BS)
    ok, bad = Request("ok", [1, 2], SamplingParams()), Request("bad", [1, 2], SamplingParams())
    for i, req in enumerate((ok, bad)):
        req.status, req.block_ids, req.num_computed_tokens = RequestStatus.RUNNING, [i], 1
    bad.grammar = BrokenGrammar()
    with pytest.raises(ValueError, match="no mask"):
        builder.build(SchedulerOutput([(ok, 1), (bad, 1)]))
    cmd = step(builder, receiver, SchedulerOutput([(ok, 1)]))
    assert (cmd.slots, cmd.num_known_blocks, cmd.new_block_ids) == ([0], [0], [[0]])


class FullSampleRow(msgspec.Struct, frozen=True):
    """A SampleRow as it was before deltas: a msgpack map, the history always whole."""

    index: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logprobs: int | None
    seed: int | None
    output_pos: int = 0
    prompt_ids: list[int] = []
    output_ids: list[int] = []
    draft_token_ids: list[int] = []
    allowed: list[bytes] = []


class FullStepCommand(msgspec.Struct, frozen=True):
    """The StepCommand before deltas: a msgpack map with every table whole, every step."""

    input_ids: list[int]
    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    micro_batch_sizes: list[int]
    samples: list[FullSampleRow]


def full_row(req: Request, index: int) -> FullSampleRow:
    fields = msgspec.structs.asdict(make_sample_row(req, index, VOCAB))
    del fields["output_start"]
    return FullSampleRow(**fields)


@pytest.mark.parametrize("penalised", [False, True])
def test_bytes_per_decode_step_at_64_requests_of_2k_context(penalised):
    """Prints the wire size of one decode step before and after deltas (no timing)."""
    block_size, context = 16, 2048
    builder = StepBuilder(block_size, 151936)
    params = PENALISED if penalised else SamplingParams(temperature=0.7, top_p=0.9)
    reqs = []
    for i in range(64):  # block ids spread over a pool of 20k blocks, as in a busy server
        req = Request(f"r{i}", [(7 * i + j) % 150000 for j in range(context - 16)], params)
        for j in range(15):
            req.append_token((11 * i + j) % 150000)
        req.status, req.num_computed_tokens = RequestStatus.RUNNING, req.num_tokens - 1
        req.block_ids = [(i * 311 + 17 * k) % 20000 + 1000 for k in range(context // block_size)]
        reqs.append(req)
    out = SchedulerOutput([(r, 1) for r in reqs])
    builder.build(out)  # the requests' first command: their tables (and histories) whole
    for req in reqs:
        req.num_computed_tokens += 1
        req.append_token(42)
    cmd, _ = builder.build(out)
    before = FullStepCommand(cmd.input_ids, cmd.query_lens, cmd.context_lens,
                             full_tables(cmd, out), cmd.micro_batch_sizes,
                             [full_row(r, i) for i, r in enumerate(reqs)])
    nbytes, nbytes_before = len(wire(cmd)), len(wire(before))
    print(f"\n64 requests x {context} tokens, penalties {'on' if penalised else 'off'}: "
          f"{nbytes_before} bytes per decode step before, {nbytes} after")
    assert nbytes * 5 < nbytes_before

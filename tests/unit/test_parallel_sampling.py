"""The step's sample rows: the same RowSampler samples in one process and on the last pipeline
stage (rows cross the wire as msgpack), and it verifies draft tokens by the documented rule.

The in-process reference is `ModelRunner.sample_from_hidden` (a stand-in model whose
`compute_logits` is the identity); the parallel path is `make_sample_row` -> msgpack ->
`RowSampler.sample` -> `to_step_tokens`.
"""

from types import SimpleNamespace

import msgspec
import pytest
import torch

from hearth.engine.parallel.messages import (Command, Reply, SampleResult, StepCommand,
                                             decode_command, decode_reply, encode)
from hearth.engine.request import Request
from hearth.engine.runner import ModelRunner
from hearth.engine.sampler import RowSampler
from hearth.engine.sampling_params import SamplingParams
from hearth.engine.scheduler import SchedulerOutput
from hearth.engine.step import StepBuilder, make_sample_row, to_step_tokens

VOCAB = 50


class OnlyTokens:
    """A grammar stand-in that allows a fixed set of tokens."""

    def __init__(self, allowed: list[int]) -> None:
        self.allowed = allowed

    def fill_mask(self, row: torch.Tensor) -> None:
        keep = torch.zeros_like(row, dtype=torch.bool)
        keep[self.allowed] = True
        row.masked_fill_(~keep, float("-inf"))

    def accept(self, token: int) -> bool:
        return token in self.allowed

    def rollback(self, n: int) -> None:
        pass

    def is_terminated(self) -> bool:
        return False


PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.9, seed=7, logprobs=3),
    SamplingParams(temperature=1.2, top_k=5, top_p=0.8, seed=11, logprobs=0),
    SamplingParams(temperature=0.0, repetition_penalty=1.5, presence_penalty=0.5,
                   frequency_penalty=0.3, logprobs=2),
    SamplingParams(temperature=0.7, min_p=0.1, seed=3),
    SamplingParams(temperature=0.0),  # guided: only tokens 5 and 9
]


def make_requests() -> list[Request]:
    reqs = []
    for i, p in enumerate(PARAMS):
        req = Request(f"r{i}", [(3 * i + j) % VOCAB for j in range(4 + i)], p)
        req.append_token((i + 1) % VOCAB)
        reqs.append(req)
    reqs[5].grammar = OnlyTokens([5, 9])
    return reqs


def reference_runner() -> ModelRunner:
    model = SimpleNamespace(arch=SimpleNamespace(vocab_size=VOCAB,
                                                 kv_cache_layout=lambda tp_size: (2, 1, 4)),
                            layers=[], tp=SimpleNamespace(size=1),
                            compute_logits=lambda hidden: hidden)
    return ModelRunner(model, num_blocks=8, block_size=16, dtype=torch.float32, seed=0)


def decode_step(reqs: list[Request]) -> StepCommand:
    for req in reqs:
        req.num_computed_tokens = req.num_tokens - 1
        req.block_ids = [0]
    cmd, _ = StepBuilder(16, VOCAB).build(SchedulerOutput([(r, 1) for r in reqs]))
    return cmd


def test_row_sampler_on_the_wire_equals_model_runner_over_steps():
    gen = torch.Generator().manual_seed(0)
    ref_reqs, par_reqs = make_requests(), make_requests()
    runner, sampler = reference_runner(), RowSampler(seed=0, vocab_size=VOCAB)
    decoder = msgspec.msgpack.Decoder(StepCommand)
    for _ in range(3):  # seeded generators must carry on across steps
        logits = torch.randn(len(PARAMS), VOCAB, generator=gen) * 3
        ref_cmd = decode_step(ref_reqs)
        want = to_step_tokens(runner.sample_from_hidden(ref_cmd, logits.clone(), ref_cmd.samples),
                              ref_reqs, ref_cmd.samples)
        cmd = decoder.decode(encode(decode_step(par_reqs)))  # the wire
        result = sampler.sample(logits.clone(), cmd.samples)
        got = to_step_tokens(decode_reply(Reply.SAMPLE_RESULT, encode(result),
                                          Reply.SAMPLE_RESULT), par_reqs, cmd.samples)
        assert [s.token_ids for s in got] == [s.token_ids for s in want]
        assert [s.logprobs for s in got] == [s.logprobs for s in want]
        assert got[5].token_ids[0] in (5, 9)
        assert len(got[1].logprobs[0].top) == 3 and got[2].logprobs[0].top == []
        for a, b, s in zip(ref_reqs, par_reqs, got):
            a.append_token(s.token_ids[0])
            b.append_token(s.token_ids[0])


def test_a_seeded_draw_depends_on_the_seed_and_output_position_alone():
    """No state on the sampler: the same row draws the same token every time, positions draw
    differently, and verifying drafts (one rejected) leaves every position's draw as it was
    without speculation."""
    sampler = RowSampler(seed=0, vocab_size=VOCAB)
    req = make_requests()[1]
    assert req.params.seed is not None and req.params.temperature > 0
    logits = torch.zeros(8, VOCAB)  # uniform: the draw is decided by the randomness alone
    row = make_sample_row(req, 0, VOCAB)

    def at(pos, drafts=()):
        r = msgspec.structs.replace(row, output_pos=pos, draft_token_ids=list(drafts))
        return sampler.sample(logits[: r.num_positions].clone(), [r]).rows[0].token_ids

    walk = [at(pos)[0] for pos in range(6)]
    assert walk == [at(pos)[0] for pos in range(6)] and len(set(walk)) > 1
    wrong = (walk[2] + 1) % VOCAB
    assert at(0, [walk[0], walk[1], wrong, walk[3]]) == walk[:3]  # stops at the rejected draft
    assert at(3, walk[3:5]) == walk[3:6]  # all accepted, plus the next position
    other = msgspec.structs.replace(row, seed=row.seed + 1)
    assert [sampler.sample(logits[:1].clone(), [msgspec.structs.replace(other, output_pos=p)])
            .rows[0].token_ids[0] for p in range(6)] != walk


def test_history_is_sent_only_when_a_penalty_reads_it():
    reqs = make_requests()
    assert make_sample_row(reqs[0], 0, VOCAB).prompt_ids == []
    row = make_sample_row(reqs[3], 3, VOCAB)
    assert row.prompt_ids == reqs[3].prompt_token_ids and row.output_ids == [4]


def test_bad_row_fails_the_step_not_the_rank():
    sampler = RowSampler(seed=0, vocab_size=VOCAB)
    row = make_sample_row(make_requests()[0], 0, VOCAB)
    row = msgspec.structs.replace(row, allowed=[b"\xff"])  # a mask of 8 tokens for a vocab of 50
    result = sampler.sample(torch.zeros(1, VOCAB), [row])
    assert result.error is not None and result.rows == []
    with pytest.raises(RuntimeError, match="sampling failed"):
        to_step_tokens(result, [make_requests()[0]], [row])


def test_commands_decode_only_as_the_type_their_header_names():
    payload = encode(StepCommand([1, 2], [2], [2], [0], [0], [[0]], 31, [1], []))
    command, cmd = decode_command(int(Command.STEP), payload)
    assert command is Command.STEP and cmd.input_ids == [1, 2]
    with pytest.raises(msgspec.ValidationError):
        decode_command(int(Command.LOAD_MODEL), payload)
    with pytest.raises(RuntimeError, match="expected SAMPLE_RESULT"):
        decode_reply(int(Reply.LOAD_REPORT), encode(SampleResult([])), Reply.SAMPLE_RESULT)


# ---- draft verification -------------------------------------------------------------------
def draft_row(params: SamplingParams, drafts: list[int], rid="d") -> tuple:
    req = Request(rid, [1, 2, 3], params)
    req.num_computed_tokens, req.block_ids = 2, [0]
    out = SchedulerOutput([(req, 1)])
    out.drafts[rid] = drafts
    cmd, reqs = StepBuilder(16, VOCAB).build(out)
    return req, cmd


def peaked(tokens: list[int]) -> torch.Tensor:
    logits = torch.zeros(len(tokens), VOCAB)
    for i, t in enumerate(tokens):
        logits[i, t] = 10.0
    return logits


def test_a_step_with_drafts_computes_them_after_the_requests_own_token():
    req, cmd = draft_row(SamplingParams(temperature=0.0), [7, 8, 9])
    assert cmd.input_ids == [3, 7, 8, 9] and cmd.query_lens == [4] and cmd.context_lens == [6]
    assert cmd.samples[0].draft_token_ids == [7, 8, 9] and cmd.samples[0].num_positions == 4


@pytest.mark.parametrize("targets, drafts, want", [
    ([7, 8, 4, 1], [7, 8, 9], [7, 8, 4]),  # two accepted, the third replaced
    ([7, 8, 9, 1], [7, 8, 9], [7, 8, 9, 1]),  # all accepted, plus the bonus token
    ([5, 8, 9, 1], [7, 8, 9], [5]),  # the first rejected: one token, as without drafts
])
def test_greedy_verification_keeps_the_agreeing_prefix(targets, drafts, want):
    req, cmd = draft_row(SamplingParams(temperature=0.0, logprobs=1), drafts)
    result = RowSampler(0, VOCAB).sample(peaked(targets), cmd.samples)
    got = to_step_tokens(result, [req], cmd.samples)[0]
    assert got.token_ids == want and got.num_drafted == 3
    assert [lp.token_id for lp in got.logprobs] == want


def test_grammar_masks_follow_the_drafts():
    req, cmd = draft_row(SamplingParams(temperature=0.0), [5])
    req.grammar = OnlyTokens([5, 9])
    cmd, _ = StepBuilder(16, VOCAB).build(SchedulerOutput([(req, 1)], drafts={"d": [5]}))
    assert len(cmd.samples[0].allowed) == 2
    logits = peaked([5, 3])  # position 1 prefers 3, which the grammar forbids
    got = RowSampler(0, VOCAB).sample(logits, cmd.samples).rows[0].token_ids
    assert got[0] == 5 and got[1] in (5, 9)


def test_sampled_verification_keeps_the_models_distribution():
    """With a fixed draft d, the first token must still follow p: P(d) = p(d), and the others
    keep their relative weights (the rejection-sampling rule for a deterministic draft)."""
    p = torch.tensor([0.5, 0.3, 0.2])
    logits = torch.full((2, VOCAB), -1e9)
    logits[:, :3] = p.log()
    n = 3000  # one step of n seeded rows (a seeded draw depends on its seed alone: see above)
    rows = [make_sample_row(Request(f"s{i}", [1, 2, 3], SamplingParams(temperature=1.0, seed=i)),
                            i, VOCAB, [1]) for i in range(n)]
    result = RowSampler(0, VOCAB).sample(logits.repeat(n, 1), rows)
    counts = torch.bincount(torch.tensor([r.token_ids[0] for r in result.rows]), minlength=3)
    freq = counts[:3].float() / n
    assert torch.allclose(freq, p, atol=0.035), freq  # ~4 standard errors


class EndsAt(OnlyTokens):
    """A grammar stand-in that terminates on `stop` and, like xgrammar, refuses to give a mask
    (or accept anything) once terminated."""

    def __init__(self, allowed: list[int], stop: int) -> None:
        super().__init__(allowed + [stop])
        self.stop, self.accepted = stop, []

    def is_terminated(self) -> bool:
        return bool(self.accepted) and self.accepted[-1] == self.stop

    def fill_mask(self, row: torch.Tensor) -> None:
        assert not self.is_terminated(), "mask asked of a terminated matcher"
        super().fill_mask(row)

    def accept(self, token: int) -> bool:
        if self.is_terminated() or token not in self.allowed:
            return False
        self.accepted.append(token)
        return True

    def rollback(self, n: int) -> None:
        del self.accepted[len(self.accepted) - n:]


def test_a_draft_that_ends_the_grammar_is_cut_after_its_stop_token():
    from hearth.engine.speculative.speculator import _grammar_prefix

    req, _ = draft_row(SamplingParams(temperature=0.0), [])
    req.grammar = EndsAt([5, 9], stop=2)
    assert _grammar_prefix(req, [5, 2, 9, 9]) == [5, 2] and req.grammar.accepted == []
    cmd, _ = StepBuilder(16, VOCAB).build(SchedulerOutput([(req, 1)], drafts={"d": [5, 2]}))
    assert len(cmd.samples[0].allowed) == 3 and req.grammar.accepted == []
    got = RowSampler(0, VOCAB).sample(peaked([5, 2, 7]), cmd.samples).rows[0].token_ids
    assert got[:2] == [5, 2]  # the request stops at 2; the third position is never used

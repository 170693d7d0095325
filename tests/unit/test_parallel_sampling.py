"""Sampling on the last pipeline stage equals sampling in one process, row for row.

The reference is `ModelRunner.sample_from_hidden` over the same logits (a stand-in model whose
`compute_logits` is the identity); the parallel path is driver `make_sample_row` -> msgpack ->
sampler `RowSampler.sample` -> driver `to_sampled_tokens`.
"""

from types import SimpleNamespace

import msgspec
import pytest
import torch

from hearth.engine.parallel.messages import (Command, Reply, SampleResult, StepCommand,
                                             decode_command, decode_reply, encode)
from hearth.engine.parallel.sampling import RowSampler, make_sample_row, to_sampled_tokens
from hearth.engine.request import Request
from hearth.engine.runner import ModelRunner
from hearth.engine.sampling_params import SamplingParams
from hearth.engine.scheduler import SchedulerOutput

VOCAB = 50


class OnlyTokens:
    """A grammar stand-in that allows a fixed set of tokens."""

    def __init__(self, allowed: list[int]) -> None:
        self.allowed = allowed

    def fill_mask(self, row: torch.Tensor) -> None:
        keep = torch.zeros_like(row, dtype=torch.bool)
        keep[self.allowed] = True
        row.masked_fill_(~keep, float("-inf"))


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
        if p.seed is not None:
            req.generator = torch.Generator().manual_seed(p.seed)
        reqs.append(req)
    reqs[5].grammar = OnlyTokens([5, 9])
    return reqs


def reference_runner() -> ModelRunner:
    model = SimpleNamespace(arch=SimpleNamespace(vocab_size=VOCAB, head_dim=4), layers=[],
                            compute_logits=lambda hidden: hidden)
    return ModelRunner(model, num_blocks=1, block_size=16, dtype=torch.float32, seed=0)


def test_row_sampler_equals_model_runner_over_steps():
    gen = torch.Generator().manual_seed(0)
    ref_reqs, par_reqs = make_requests(), make_requests()
    runner, sampler = reference_runner(), RowSampler(seed=0, vocab_size=VOCAB)
    decoder = msgspec.msgpack.Decoder(StepCommand)
    for _ in range(3):  # seeded generators must carry on across steps
        logits = torch.randn(len(PARAMS), VOCAB, generator=gen) * 3
        for req in ref_reqs:
            req.num_computed_tokens = req.num_tokens - 1
        want = runner.sample_from_hidden(SchedulerOutput([(r, 1) for r in ref_reqs]),
                                         logits.clone())
        rows = [make_sample_row(r, i, VOCAB) for i, r in enumerate(par_reqs)]
        cmd = decoder.decode(encode(StepCommand([], [], [], [], [], rows)))  # the wire
        result = sampler.sample(logits.clone(), cmd.samples)
        got = to_sampled_tokens(decode_reply(Reply.SAMPLE_RESULT, encode(result),
                                             Reply.SAMPLE_RESULT), par_reqs)
        assert [s.token_id for s in got] == [s.token_id for s in want]
        assert [s.logprob for s in got] == [s.logprob for s in want]
        assert got[5].token_id in (5, 9)
        for a, b, s in zip(ref_reqs, par_reqs, got):
            a.append_token(s.token_id)
            b.append_token(s.token_id)


def test_forgotten_request_restarts_its_seeded_generator():
    sampler = RowSampler(seed=0, vocab_size=VOCAB)
    req = make_requests()[1]
    logits = torch.zeros(1, VOCAB)  # uniform: the draw is decided by the generator alone
    row = make_sample_row(req, 0, VOCAB)
    first = [sampler.sample(logits.clone(), [row]).token_ids[0] for _ in range(4)]
    sampler.forget([req.request_id])
    again = [sampler.sample(logits.clone(), [row]).token_ids[0] for _ in range(4)]
    assert first == again and len(set(first)) > 1


def test_history_is_sent_only_when_a_penalty_reads_it():
    reqs = make_requests()
    assert make_sample_row(reqs[0], 0, VOCAB).prompt_ids == []
    row = make_sample_row(reqs[3], 3, VOCAB)
    assert row.prompt_ids == reqs[3].prompt_token_ids and row.output_ids == [4]


def test_bad_row_fails_the_step_not_the_rank():
    sampler = RowSampler(seed=0, vocab_size=VOCAB)
    row = make_sample_row(make_requests()[0], 0, VOCAB)
    row = msgspec.structs.replace(row, allowed=b"\xff")  # a mask of 8 tokens for a vocab of 50
    result = sampler.sample(torch.zeros(1, VOCAB), [row])
    assert result.error is not None and result.token_ids == []
    with pytest.raises(RuntimeError, match="sampling failed on the last pipeline stage"):
        to_sampled_tokens(result, [make_requests()[0]])


def test_commands_decode_only_as_the_type_their_header_names():
    payload = encode(StepCommand([1, 2], [2], [2], [[0]], [1], []))
    command, cmd = decode_command(int(Command.STEP), payload)
    assert command is Command.STEP and cmd.input_ids == [1, 2]
    with pytest.raises(msgspec.ValidationError):
        decode_command(int(Command.LOAD_MODEL), payload)
    with pytest.raises(RuntimeError, match="expected SAMPLE_RESULT"):
        decode_reply(int(Reply.LOAD_REPORT), encode(SampleResult([1])), Reply.SAMPLE_RESULT)

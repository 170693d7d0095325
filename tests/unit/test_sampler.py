"""Sampler: greedy, seeded reproducibility, top-k/top-p/min-p masks, penalties, logprobs."""

import math

import pytest
import torch

from hearth.engine.refusals import RequestRejected
from hearth.engine.sampler import apply_filters, apply_penalties, make_sampling_batch, sample
from hearth.engine.sampling_params import SamplingParams

V = 8


def make_batch(params, histories=None, seeds=None):
    histories = histories or [([], [])] * len(params)
    gens = [torch.Generator().manual_seed(s) if s is not None else None
            for s in (seeds or [p.seed for p in params])]
    return make_sampling_batch(params, histories, gens, V)


def test_greedy_is_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0, 0, 0, 0, 0, 0], [5.0, 0, 0, 0, 0, 0, 0, 6.0]])
    tokens, _, _ = sample(logits, make_batch([SamplingParams(temperature=0)] * 2))
    assert tokens.tolist() == [1, 7]


def test_same_seed_same_tokens_regardless_of_batch():
    logits = torch.randn(1, V)
    p = SamplingParams(temperature=1.0, seed=42)
    alone = [sample(logits, make_batch([p]))[0].item() for _ in range(5)]
    other = SamplingParams(temperature=1.0)
    together = [sample(torch.cat([torch.randn(1, V), logits]),
                       make_batch([other, p]))[0][1].item() for _ in range(5)]
    assert alone == together
    # a seeded generator keeps its state across steps: a different seed draws another sequence
    flat = torch.zeros(1, V)  # uniform: every draw is informative
    batch_a, batch_b = make_batch([SamplingParams(seed=1)]), make_batch([SamplingParams(seed=2)])
    a = [sample(flat, batch_a)[0].item() for _ in range(20)]
    b = [sample(flat, batch_b)[0].item() for _ in range(20)]
    assert a != b
    again = make_batch([SamplingParams(seed=1)])
    assert [sample(flat, again)[0].item() for _ in range(20)] == a


def test_top_k_mask_keeps_exactly_k():
    logits = torch.arange(V, dtype=torch.float).repeat(2, 1)
    b = make_batch([SamplingParams(top_k=3), SamplingParams(top_k=1)])
    out = apply_filters(logits, b)
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [5, 6, 7]
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == [7]


def test_top_p_keeps_smallest_prefix_reaching_p():
    probs = torch.tensor([[0.5, 0.3, 0.1, 0.05, 0.03, 0.01, 0.005, 0.005]])
    logits = probs.log()
    out = apply_filters(logits, make_batch([SamplingParams(top_p=0.75)]))
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [0, 1]
    out = apply_filters(logits, make_batch([SamplingParams(top_p=0.85)]))
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [0, 1, 2]


def test_min_p_drops_tokens_below_fraction_of_max():
    probs = torch.tensor([[0.5, 0.3, 0.1, 0.05, 0.03, 0.01, 0.005, 0.005]])
    out = apply_filters(probs.log(), make_batch([SamplingParams(min_p=0.15)]))
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [0, 1, 2]


def test_penalties():
    logits = torch.tensor([[2.0, -2.0, 1.0, 1.0, 0, 0, 0, 0]])
    b = make_batch([SamplingParams(repetition_penalty=2.0, presence_penalty=0.5,
                                   frequency_penalty=0.25)], histories=[([0], [1, 2, 2])])
    out = apply_penalties(logits, b)
    # token 0: in prompt only -> repetition only: 2 / 2
    assert out[0, 0].item() == pytest.approx(1.0)
    # token 1: once in output -> -2 * 2 - 0.25 - 0.5
    assert out[0, 1].item() == pytest.approx(-4.75)
    # token 2: twice in output -> 1 / 2 - 0.5 - 0.5
    assert out[0, 2].item() == pytest.approx(-0.5)
    assert out[0, 3].item() == 1.0


def test_logprobs_are_of_raw_distribution():
    logits = torch.tensor([[1.0, 2.0, 3.0, 0, 0, 0, 0, 0]])
    tokens, chosen, top = sample(logits, make_batch([SamplingParams(temperature=0, logprobs=2)]))
    ref = logits.log_softmax(-1)
    assert tokens.item() == 2
    assert chosen.item() == pytest.approx(ref[0, 2].item())
    assert top.indices[0].tolist() == [2, 1]
    assert math.isclose(top.values[0, 1].item(), ref[0, 1].item(), rel_tol=1e-6)


@pytest.mark.parametrize("field,value", [("temperature", -1), ("top_p", 0), ("top_k", -5),
                                         ("min_p", 2), ("max_tokens", 0),
                                         ("presence_penalty", 3), ("logprobs", 50)])
def test_invalid_params_name_the_field(field, value):
    with pytest.raises(RequestRejected, match=field) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field


def test_greedy_takes_the_first_maximal_index_as_argmax_does():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 4, (6, V), generator=gen).float()  # ties in every row
    logits[2, 5] = float("nan")  # NaN wins, as in argmax
    for rows in ([SamplingParams(temperature=0)] * 6,  # all greedy
                 [SamplingParams(temperature=0)] * 5 + [SamplingParams(temperature=1.0, seed=1)]):
        b = make_sampling_batch(rows, [([], [])] * 6, [None] * 5 + [torch.Generator()], V)
        tokens = sample(logits, b)[0]
        assert torch.equal(tokens[:5], logits.argmax(-1)[:5])

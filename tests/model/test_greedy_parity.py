"""Greedy outputs of the real default model equal HF transformers' (golden file), in every mode.

The golden file (`make_golden.py`) holds transformers' plain greedy loop in fp32. fp32 sums in a
different order can flip a near-tie, so a divergence is accepted only at a step where the
reference's top-2 logits are within 1e-4 (`TIE`); after it, the rest of that sequence is not
compared. So far no case has needed it.
"""

import json
from pathlib import Path

import pytest

from hearth.engine.sampling_params import SamplingParams

GOLDEN = json.loads((Path(__file__).parent / "golden" / "smollm2_greedy.json").read_text())
CASES = GOLDEN["cases"]
TIE = 1e-4
GREEDY = SamplingParams(temperature=0.0, max_tokens=GOLDEN["num_new"], ignore_eos=True)


def assert_matches(case: dict, got: list[int]) -> None:
    want, margins = case["output_ids"], case["top2_margins"]
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            assert margins[i] < TIE, (
                f"{case['prompt']!r}: token {i} is {g}, reference {w} "
                f"(reference top-2 margin {margins[i]:.2e} is not a tie)")
            return


def test_tokenizer_and_chat_template_match_reference(checkpoint):
    from hearth.engine.text.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_checkpoint(checkpoint)  # what LLM builds; no model needed
    for case in CASES:
        text = tokenizer.apply_chat_template([{"role": "user", "content": case["prompt"]}])
        assert text == case["chat_text"]
        assert tokenizer.encode(text) == case["prompt_ids"]


def test_one_at_a_time(models):
    llm = models.llm(enable_prefix_caching=False)
    for case in CASES:
        [out] = llm.generate([case["prompt_ids"]], GREEDY)
        assert_matches(case, out.token_ids)
        assert out.finish_reason == "length" and out.cached_tokens == 0


def test_all_batched_with_tiny_prefill_chunks(models):
    # 16-token budget: every prompt is split into chunks while the others decode beside it.
    for budget in (4096, 16):
        llm = models.llm(max_num_batched_tokens=budget, enable_prefix_caching=False)
        outs = llm.generate([c["prompt_ids"] for c in CASES], GREEDY)
        for case, out in zip(CASES, outs):
            assert_matches(case, out.token_ids)
        assert llm.engine.kv_pool_is_whole()


def test_prefix_cache_hits(models):
    llm = models.llm()
    first = llm.generate([c["prompt_ids"] for c in CASES[:3]], GREEDY)
    second = llm.generate([c["prompt_ids"] for c in CASES[:3]], GREEDY)
    for case, a, b in zip(CASES, first, second):
        assert a.cached_tokens == 0
        # every full block of the prompt is reused (at least one token is always recomputed)
        assert b.cached_tokens == (len(case["prompt_ids"]) - 1) // 16 * 16 > 0
        assert_matches(case, b.token_ids)
    assert llm.engine.kv_pool_is_whole()


def test_under_preemption(models):
    # 12 blocks of 16 tokens cannot hold 8 sequences of ~40 + 40 tokens: requests get preempted
    # and recomputed, and must still produce the reference tokens.
    llm = models.llm(num_blocks=12)
    outs = llm.generate([c["prompt_ids"] for c in CASES], GREEDY)
    assert llm.engine.counters.preemptions > 0
    for case, out in zip(CASES, outs):
        assert_matches(case, out.token_ids)
    assert llm.engine.kv_pool_is_whole()


def test_under_the_servers_step_policy(models):
    # `hearth serve`'s step policy: decodes granted first, prompt tokens bounded beside them,
    # and a prompt already cached (an agent's next turn) admitted before cold ones queued
    # earlier. Prompts arrive while others decode; every output is still the reference's.
    llm = models.llm(itl_target_ms=40.0, max_prompt_tokens_while_decoding=64, max_num_seqs=3)
    engine = llm.engine
    requests, outputs = {}, {}

    def add(rid, case):
        requests[rid] = (engine.add_request(rid, case["prompt_ids"], GREEDY), case)
        outputs[rid] = []

    def step():
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids

    add("first0", CASES[0])
    add("first1", CASES[1])
    for _ in range(3):
        step()
    for i in range(2, 8):  # more than the free seat: the rest queue
        add(f"cold{i}", CASES[i])
    while not requests["first0"][0].is_finished:
        step()
    add("again0", CASES[0])  # the same prompt again: all but its last block cached
    while engine.has_unfinished():
        step()
    for rid, (req, case) in requests.items():
        assert_matches(case, outputs[rid])
    again = requests["again0"][0]
    assert again.num_cached_tokens == (len(CASES[0]["prompt_ids"]) - 1) // 16 * 16 > 0
    # it passed the cold prompts that were still queued when it came
    passed = [req for rid, (req, _) in requests.items() if rid.startswith("cold")
              and req.first_scheduled_time > again.first_scheduled_time]
    assert passed and all(req.num_bypassed >= 1 for req in passed)
    assert engine.kv_pool_is_whole()

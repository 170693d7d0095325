"""LLMEngine's own logic over a scripted executor (no model): scheduling, chunked prefill, prefix
hits, preemption, stops, aborts, failure isolation and the pool coming back whole.

The executor is the engine's declared seam (`hearth.engine.step.Executor`); the one here answers
every sampled row with a token that depends only on the request's token history (the sum of its
input ids so far, mod the vocabulary), so an answer is the same whether a request ran alone, in a
batch, in chunks, after a prefix hit or after a preemption: exactly what the engine must
guarantee of a real model, checked here in milliseconds. The model tiers (tests/model) check the
same paths with real weights.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit

from hearth.engine.engine import LLMEngine
from hearth.engine.llm import make_engine_config
from hearth.engine.sampling_params import SamplingParams
from hearth.engine.step import RowOutput, SampleResult, StepCommand
from hearth.engine.step_state import StepReceiver
from hearth.models.arch import ModelArch
from hearth.models.checkpoint import TokenizerSource

WORDS = ["<eos>"] + [f"w{i}" for i in range(63)]
VOCAB = len(WORDS)  # 64
EOS = 0
BLOCK = 4


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("scripted-tokenizer")
    backend = HFTokenizer(WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<eos>"))
    backend.pre_tokenizer = WhitespaceSplit()
    backend.add_special_tokens(["<eos>"])
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    return folder


@dataclass
class ScriptedCheckpoint:
    arch: ModelArch
    name: str
    tokenizer_source: TokenizerSource


class ScriptedExecutor:
    """Next token = (sum of the request's ids so far + 1) % VOCAB, skipping EOS unless the sum
    hits `eos_at`; records every command; raises for a step holding a `poison` input id.
    (Histories are kept per request's first block, so requests sharing a prefix block must not
    run at the same time in these tests.)"""

    def __init__(self, num_blocks: int, poison: int | None = None, eos_at: int | None = None):
        self.num_blocks = num_blocks
        self.num_micro_batches = 1
        self.kv_cache = torch.zeros(1, 2, num_blocks, BLOCK, 1, 1)
        self.poison, self.eos_at = poison, eos_at
        self.commands: list[StepCommand] = []
        self.receiver = StepReceiver(BLOCK)  # the request slots' block tables
        self.history: dict[int, list[int]] = {}  # a request's first block -> ids seen
        self.closed = False

    def execute(self, cmd: StepCommand) -> SampleResult:
        self.commands.append(cmd)
        if self.poison is not None and self.poison in cmd.input_ids:
            raise RuntimeError("poisoned batch")  # before applying it: the engine resends
        tables = self.receiver.receive(cmd).block_tables
        # The history is what the engine put in each request's KV (a cached prefix is not
        # resent): recorded per block table's first block, cut back to where this chunk starts.
        contexts, start = {}, 0
        for i, (q, c) in enumerate(zip(cmd.query_lens, cmd.context_lens)):
            seen = self.history.setdefault(tables[i][0], [])
            del seen[c - q:]
            seen.extend(cmd.input_ids[start:start + q])
            start += q
            contexts[i] = (c, seen)
        out = []
        for row in cmd.samples:
            context, seen = contexts[row.index]
            total = sum(seen[:context])
            token = (total + 1) % VOCAB
            if token == EOS:
                token = 1
            if self.eos_at is not None and context >= self.eos_at:
                token = EOS
            out.append(RowOutput([token]))
        return SampleResult(out)

    def expert_load(self) -> dict[int, list[int]]:
        return {}

    def close(self) -> None:
        self.closed = True


def expected_tokens(prompt: list[int], n: int) -> list[int]:
    ids, out = list(prompt), []
    for _ in range(n):
        token = (sum(ids) + 1) % VOCAB or 1
        out.append(token)
        ids.append(token)
    return out


def make_engine(tokenizer_folder, num_blocks=64, executor=None, **kw) -> LLMEngine:
    arch = ModelArch(architecture="llama", vocab_size=VOCAB, hidden_size=8,
                     intermediate_size=16, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=8,
                     max_position_embeddings=512, eos_token_ids=(EOS,))
    checkpoint = ScriptedCheckpoint(arch, "scripted", TokenizerSource(folder=tokenizer_folder))
    config = make_engine_config("scripted", block_size=BLOCK, **kw)
    return LLMEngine(config, checkpoint, executor=executor or ScriptedExecutor(num_blocks))


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]],
        max_steps: int = 500) -> dict[str, dict]:
    """Add the requests, step until all finish; the pool must then be whole."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    results = {rid: {"tokens": [], "text": "", "reason": None, "cached": 0} for rid in requests}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            r = results[out.request_id]
            r["tokens"] += out.new_token_ids
            r["text"] += out.new_text
            if out.finished:
                r["reason"], r["cached"], r["error"] = out.finish_reason, out.num_cached_tokens, out.error
    assert not engine.has_unfinished()
    assert engine.kv_pool_is_whole()
    return results


def prompt_of(seed: int, n: int) -> list[int]:
    return [1 + (seed * 7 + i * 3) % (VOCAB - 1) for i in range(n)]


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, **kw)


def test_batch_equals_each_request_alone_and_the_pool_comes_back_whole(tokenizer_folder):
    prompts = {f"r{i}": prompt_of(i, 5 + 3 * i) for i in range(5)}
    engine = make_engine(tokenizer_folder)
    results = run(engine, {rid: (p, greedy(6)) for rid, p in prompts.items()})
    for rid, p in prompts.items():
        assert results[rid]["tokens"] == expected_tokens(p, 6)
        assert results[rid]["reason"] == "length"
    assert max(len(c.query_lens) for c in engine.executor.commands) == 5  # they did share steps


def test_a_long_prompt_is_prefilled_in_chunks_of_the_token_budget(tokenizer_folder):
    engine = make_engine(tokenizer_folder, max_num_batched_tokens=8)
    prompt = prompt_of(3, 30)
    results = run(engine, {"long": (prompt, greedy(3))})
    assert results["long"]["tokens"] == expected_tokens(prompt, 3)
    prefill = [c.query_lens[0] for c in engine.executor.commands[:4]]
    assert prefill == [8, 8, 8, 6]
    assert [len(c.samples) for c in engine.executor.commands[:4]] == [0, 0, 0, 1]


def test_a_repeated_prefix_is_not_computed_again(tokenizer_folder):
    engine = make_engine(tokenizer_folder)
    prompt = prompt_of(5, 17)  # 4 full blocks and one token
    first = run(engine, {"a": (prompt, greedy(2))})
    computed_before = sum(c.num_tokens for c in engine.executor.commands)
    second = run(engine, {"b": (prompt, greedy(2))})
    computed = sum(c.num_tokens for c in engine.executor.commands) - computed_before
    assert second["b"]["tokens"] == first["a"]["tokens"] == expected_tokens(prompt, 2)
    assert second["b"]["cached"] == 16
    assert computed == 1 + 1  # the last prompt token, then one decode step


def test_preempted_requests_finish_with_the_same_tokens(tokenizer_folder):
    # 12 blocks of 4 tokens: three requests of 12 prompt + 16 output tokens (7 blocks each) do
    # not fit at once, so the scheduler preempts and later recomputes.
    engine = make_engine(tokenizer_folder, num_blocks=12, executor=ScriptedExecutor(12))
    prompts = {f"p{i}": prompt_of(10 + i, 12) for i in range(3)}
    results = run(engine, {rid: (p, greedy(16)) for rid, p in prompts.items()})
    assert engine.counters.preemptions > 0
    for rid, p in prompts.items():
        assert results[rid]["tokens"] == expected_tokens(p, 16)


def test_eos_stop_tokens_and_stop_strings(tokenizer_folder):
    prompt = prompt_of(1, 6)
    want = expected_tokens(prompt, 8)
    engine = make_engine(tokenizer_folder, executor=ScriptedExecutor(64, eos_at=len(prompt) + 3))
    results = run(engine, {"eos": (prompt, greedy(8))})
    assert results["eos"]["tokens"] == want[:3] + [EOS] and results["eos"]["reason"] == "stop"
    assert "<eos>" not in results["eos"]["text"]

    engine = make_engine(tokenizer_folder)
    results = run(engine, {"ids": (prompt, greedy(8, stop_token_ids=(want[2],))),
                           "text": (prompt, greedy(8, stop=(WORDS[want[4]],)))})
    assert results["ids"]["tokens"] == want[:3] and results["ids"]["reason"] == "stop"
    assert results["text"]["reason"] == "stop"
    assert WORDS[want[4]] not in results["text"]["text"]
    assert results["text"]["text"].split() == [WORDS[t] for t in want[:4]]


def test_abort_frees_the_requests_blocks(tokenizer_folder):
    engine = make_engine(tokenizer_folder)
    engine.add_request("gone", prompt_of(2, 10), greedy(50))
    engine.add_request("kept", prompt_of(3, 10), greedy(5))
    engine.step()
    engine.step()
    engine.abort_request("gone")
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.finish_reason
    outputs.update({o.request_id: o.finish_reason for o in engine.step() if o.finished})
    assert outputs == {"gone": "abort", "kept": "length"}
    assert engine.kv_pool_is_whole()


def test_a_failing_request_is_isolated_from_its_batch(tokenizer_folder):
    poison = 62
    engine = make_engine(tokenizer_folder, executor=ScriptedExecutor(64, poison=poison))
    good = {f"g{i}": prompt_of(20 + i, 6) for i in range(3)}
    good = {rid: [t for t in p if t != poison] for rid, p in good.items()}
    requests = {rid: (p, greedy(4)) for rid, p in good.items()}
    requests["bad"] = ([5, poison, 7], greedy(4))
    results = run(engine, requests)
    assert results["bad"]["reason"] == "error" and "poisoned batch" in results["bad"]["error"]
    for rid, p in good.items():
        assert results[rid]["tokens"] == expected_tokens(p, 4)


def test_bad_requests_are_refused_before_they_queue(tokenizer_folder):
    from hearth.engine.refusals import RequestRejected

    engine = make_engine(tokenizer_folder)
    with pytest.raises(RequestRejected):
        engine.add_request("empty", [], greedy(4))
    with pytest.raises(RequestRejected):
        engine.add_request("oov", [VOCAB + 5], greedy(4))
    with pytest.raises(RequestRejected):
        engine.add_request("long", prompt_of(1, 600), greedy(4))
    with pytest.raises(RequestRejected):
        engine.add_request("too-many", prompt_of(1, 500), greedy(100))
    assert not engine.has_unfinished() and engine.kv_pool_is_whole()
    engine.add_request("dup", prompt_of(1, 4), greedy(2))
    with pytest.raises(RequestRejected):
        engine.add_request("dup", prompt_of(1, 4), greedy(2))
    while engine.has_unfinished():
        engine.step()
    assert engine.kv_pool_is_whole()


def test_close_closes_the_executor(tokenizer_folder):
    engine = make_engine(tokenizer_folder)
    engine.close()
    assert engine.executor.closed


def test_step_policy_keeps_outputs_and_reports_where_the_first_token_went(tokenizer_folder):
    """Prompt chunks beside decodes stay within the step's prompt cap and a cached next turn
    passes a cold prompt; every answer is still each request's own (greedy output unchanged),
    and the finished outputs say where each TTFT went."""
    engine = make_engine(tokenizer_folder, num_blocks=256, executor=ScriptedExecutor(256),
                         max_num_batched_tokens=256, max_prompt_tokens_while_decoding=64,
                         max_num_seqs=3)
    first = prompt_of(7, 40)
    requests = {"turn1": (first, greedy(2))}
    results = run(engine, requests)
    session = first + results["turn1"]["tokens"]
    prompts = {"d0": prompt_of(1, 6), "d1": prompt_of(2, 6), "cold": prompt_of(3, 200),
               "turn2": session + prompt_of(9, 6)}
    engine.executor.commands.clear()
    engine.add_request("d0", prompts["d0"], greedy(30))
    engine.add_request("d1", prompts["d1"], greedy(30))
    outputs = {rid: [] for rid in prompts}
    finished = {}

    def step():
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids
            if out.finished:
                finished[out.request_id] = out

    step()
    engine.add_request("cold", prompts["cold"], greedy(4))
    engine.add_request("turn2", prompts["turn2"], greedy(4))
    while engine.has_unfinished():
        step()
    assert engine.kv_pool_is_whole()
    for rid, prompt in prompts.items():
        assert outputs[rid] == expected_tokens(prompt, len(outputs[rid]))
        assert finished[rid].finish_reason == "length"
    # the cached turn took the free seat first; the cold prompt then ran in chunks of at most 64
    # prompt tokens beside the two decodes (decode rows have one token each: no drafts here)
    # turn2 (48 tokens, 40 of them cached) took the one free seat before the cold prompt that
    # came first; the cold prompt then ran in chunks of at most 64 tokens beside the two decodes
    steps = [c.query_lens for c in engine.executor.commands]
    assert steps[:9] == [[6, 6], [1, 1, 8], [1, 1, 1], [1, 1, 1], [1, 1, 1],
                         [1, 1, 64], [1, 1, 64], [1, 1, 64], [1, 1, 8]]
    assert finished["turn2"].num_cached_tokens == 40
    # the step that gave each its first token: its last prompt tokens beside the two decodes
    assert finished["turn2"].first_step_tokens == finished["cold"].first_step_tokens == 10
    cold = finished["cold"]
    parts = (cold.queue_seconds, cold.prompt_chunks_seconds, cold.first_step_seconds)
    assert all(p is not None and p >= 0 for p in parts)
    stats = engine.stats()  # the policy's figures, as /load and /metrics carry them
    assert stats.prompt_tokens_while_decoding == 64

"""Grammar-constrained decoding over a small byte-level BPE built here (no model needed).

A random-logits walk under the mask must always produce a valid sentence of the grammar: that
is the whole promise guided decoding makes to the sampler.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from hearth.engine.sampling_params import GuidedSpec

EOS = "<eos>"
CORPUS = [
    '{"city": "Paris", "days": 3, "unit": "celsius"}',
    '{"name": "get_weather", "arguments": {"location": "Oslo"}}',
    "<tool_call> </tool_call> yes no true false null 0123456789 [ ] { } : , \" \\",
    "The quick brown fox jumps over the lazy dog.",
]


class SmallTokenizer:
    """The part of hearth's Tokenizer that guided decoding reads."""

    def __init__(self) -> None:
        hf = Tokenizer(models.BPE())
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        hf.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=400, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        )
        hf.train_from_iterator(CORPUS * 20, trainer)
        self.backend = hf
        self.vocab_size = hf.get_vocab_size(with_added_tokens=True)
        self.eos_token_ids = (hf.token_to_id(EOS),)

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids, skip_special_tokens=True)

    def non_ascii_ids(self) -> torch.Tensor:
        """Ids whose bytes are not printable ASCII (and not a special token)."""
        ids = [i for i in range(self.vocab_size)
               if i not in self.eos_token_ids and not self.decode([i]).isascii()]
        return torch.tensor(ids, dtype=torch.long)


@pytest.fixture(scope="module")
def tokenizer() -> SmallTokenizer:
    return SmallTokenizer()


@pytest.fixture(scope="module")
def compiler(tokenizer):
    # xgrammar (~0.9 s to import) only where a test compiles: each make-test worker collects
    # every file
    from hearth.engine.guided.grammar import GrammarCompiler

    return GrammarCompiler(tokenizer, vocab_size=tokenizer.vocab_size + 64)  # padded lm_head


def constrained_walk(compiler, tokenizer, spec: GuidedSpec, seed: int, max_steps: int = 300,
                     boost: torch.Tensor | None = None) -> str:
    """Sample from random logits under the mask until EOS; return the decoded text.

    The random "model" writes ASCII only: byte-level grammars admit any byte sequence inside a
    string, including invalid UTF-8 a real model never produces token by token. `boost` (ids)
    get their logits raised, to steer an unbounded grammar towards closing.
    """
    matcher = compiler.matcher(spec)
    non_ascii = tokenizer.non_ascii_ids()
    generator = torch.Generator().manual_seed(seed)
    eos = tokenizer.eos_token_ids[0]
    token_ids = []
    for _ in range(max_steps):
        logits = torch.randn(compiler.vocab_size, generator=generator)
        logits[non_ascii] = float("-inf")
        if boost is not None:
            logits[boost] += 4.0
        matcher.fill_mask(logits)
        assert torch.isinf(logits[tokenizer.vocab_size :]).all()  # ids the tokenizer lacks
        token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))
        assert matcher.accept(token)
        if token == eos:
            assert matcher.is_terminated()
            return tokenizer.decode(token_ids)
        token_ids.append(token)
    raise AssertionError(f"no EOS after {max_steps} steps: {tokenizer.decode(token_ids)!r}")


SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "days", "unit"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("seed", range(8))
def test_json_schema_walk_always_validates(compiler, tokenizer, seed):
    text = constrained_walk(compiler, tokenizer, GuidedSpec("json_schema", json.dumps(SCHEMA)), seed)
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("seed", range(3))
def test_json_object_walk_is_an_object(compiler, tokenizer, seed):
    # An unbounded object closes within the budget only if the walk favours closing tokens.
    closing = torch.tensor([i for i in range(tokenizer.vocab_size)
                            if set("}]\"") & set(tokenizer.decode([i]))] + list(tokenizer.eos_token_ids))
    text = constrained_walk(compiler, tokenizer, GuidedSpec("json_object"), seed, max_steps=2000,
                            boost=closing)
    assert isinstance(json.loads(text), dict)


def test_regex_allows_exactly_the_language(compiler, tokenizer):
    for seed in range(5):
        assert constrained_walk(compiler, tokenizer, GuidedSpec("regex", "(yes|no)"), seed) in ("yes", "no")


def test_rejected_token_leaves_state_unchanged_and_rollback_undoes(compiler, tokenizer):
    matcher = compiler.matcher(GuidedSpec("regex", "ab"))
    a, b = tokenizer.backend.token_to_id("a"), tokenizer.backend.token_to_id("b")
    assert not matcher.accept(b)
    assert matcher.accept(a)
    assert matcher.accept(b) and matcher.is_complete()
    matcher.rollback(1)
    assert not matcher.is_complete()
    assert matcher.accept(b)
    assert not matcher.accept(compiler.vocab_size - 1)  # padded id: never allowed


def test_bfloat16_logits_are_masked_too(compiler):
    matcher = compiler.matcher(GuidedSpec("regex", "(yes|no)"))
    logits = torch.zeros(compiler.vocab_size, dtype=torch.bfloat16)
    matcher.fill_mask(logits)
    assert 0 < int(torch.isfinite(logits).sum()) < 10


@pytest.mark.parametrize(
    "spec, message",
    [
        (GuidedSpec("json_schema", "{not json"), "not valid JSON"),
        (GuidedSpec("json_schema", '{"type": "nonsense"}'), "invalid json_schema"),
        (GuidedSpec("json_schema", "[1, 2]"), "must be a JSON object"),
        (GuidedSpec("regex", "(unclosed"), "invalid regex"),
        (GuidedSpec("grammar", 'root ::= "a" |'), "invalid grammar"),
        (GuidedSpec("yaml", "x: 1"), "unknown kind"),
    ],
)
def test_invalid_specs_are_value_errors(compiler, spec, message):
    with pytest.raises(ValueError, match=message):
        compiler.matcher(spec)


def test_structural_tag_tool_call(compiler, tokenizer):
    """The shape the server sends for tool_choice=required: one Hermes call, valid arguments."""
    params = {"type": "object", "properties": {"days": {"type": "integer"}}, "required": ["days"]}
    tag = {
        "type": "structural_tag",
        "format": {
            "type": "tag",
            "begin": '<tool_call>\n{"name": "get_weather", "arguments": ',
            "content": {"type": "json_schema", "json_schema": params, "max_whitespace_cnt": 1},
            "end": "}\n</tool_call>",
        },
    }
    text = constrained_walk(compiler, tokenizer, GuidedSpec("structural_tag", json.dumps(tag)), 0)
    assert text.startswith("<tool_call>\n") and text.endswith("\n</tool_call>")
    call = json.loads(text[len("<tool_call>\n") : -len("\n</tool_call>")])
    assert call["name"] == "get_weather" and isinstance(call["arguments"]["days"], int)


def test_pool_caches_by_canonical_json_keeping_key_order(compiler):
    from hearth.config import GuidedConfig
    from hearth.engine.guided.grammar_pool import GrammarPool

    pool = GrammarPool(compiler, GuidedConfig(num_compile_threads=1))
    try:
        first = pool.submit(GuidedSpec("json_schema", json.dumps(SCHEMA)))
        first.entry.future.result()  # the compile ends
        spaced = pool.submit(GuidedSpec("json_schema", json.dumps(SCHEMA, indent=4)))
        assert spaced.entry is first.entry and spaced.is_compiled()
        reordered = dict(reversed(list(SCHEMA.items())))  # same keys: a different grammar
        other = pool.submit(GuidedSpec("json_schema", json.dumps(reordered)))
        assert other.entry is not first.entry
        assert pool.counters["hits"] == 1 and pool.counters["misses"] == 2
        for ticket in (first, spaced):
            assert pool.matcher(ticket).accept_text('{"city": "Oslo", "days": 2, "unit": "celsius"}')
        pool.release(other)
    finally:
        pool.close()

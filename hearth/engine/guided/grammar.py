"""Grammar-constrained decoding: a `GuidedSpec` becomes a per-request token `Matcher`.

Built on xgrammar (CPU). One `GrammarCompiler` per engine holds the tokenizer's vocabulary in
xgrammar's form and a cache of compiled grammars (an agent's tool set compiles once). Each
request gets its own `Matcher`, which the sampler drives once per decoded token:

    matcher.fill_mask(logits_row)   # disallowed tokens -> -inf (in place)
    token = sample(logits_row)
    matcher.accept(token)           # advances the grammar; False if the token was not allowed

Invariant: the mask only ever allows tokens that keep the output a prefix of a sentence of the
grammar; once the grammar is complete only the tokenizer's EOS ids remain allowed, so a
constrained request ends with finish_reason "stop" (or "length" if max_tokens runs out first).

Vocabulary sizes: the model's logits row may be longer than the tokenizer's vocabulary (padded
lm_head). Ids the tokenizer does not know are always disallowed.

Forced tokens (jump-forward). Where the grammar admits exactly one continuation (a tool call's
`<tool_call>\n{"name": "f", "arguments": ` wrapper, object keys, `":`), the matcher tokenizes it
(xgrammar's `find_jump_forward_tokens`: longest vocabulary tokens, leaving out a last token that
a longer one could extend) right after each *sampled* token. Those tokens are the only ones
allowed until they are all accepted. With `jump_forward` the engine appends them at once
(`forced_token_ids`: they enter the KV as one chunk, no decode step each); without it the mask
allows only the next forced token, so the output is token-for-token the same, one decode step
per token (the parity reference).

    sampled t -> accept(t) -> forced = [f1, f2, f3]
      jump_forward:  forced_token_ids() -> [f1, f2, f3]; the engine appends and accepts them
      otherwise:     fill_mask -> only f1; accept(f1); fill_mask -> only f2; ...

JSON in structural tags: a `json_schema` node that carries `"separators": [",", ":"]` (hearth's
extension; the tool-call grammars use it) compiles with exactly those separators and no other
whitespace, so the arguments come out compact and their keys and `":` are forced too.
"""

from __future__ import annotations

import json
from collections import deque
from typing import Any

import torch
import xgrammar as xgr
from xgrammar.tokenizer_info import TokenizerInfo

from hearth.engine.guided.json_schemas import (MAX_JSON_WHITESPACE, bounded_strings_as_patterns,  # noqa: F401
                                         parse_json_schema)
from hearth.engine.sampling_params import GuidedSpec

GUIDED_KINDS = ("json_schema", "json_object", "regex", "grammar", "structural_tag")



def _encoded_vocab(tokenizer: Any) -> tuple[list[str], str | None]:
    """The vocabulary as token strings indexed by id, plus the HF tokenizer JSON if available."""
    hf = getattr(tokenizer, "backend", None)  # the wrapped `tokenizers.Tokenizer`
    vocab_size = int(tokenizer.vocab_size)
    if hf is not None:
        vocab = hf.get_vocab(with_added_tokens=True)
        size = max(vocab_size, max(vocab.values()) + 1)
        encoded = [""] * size
        for token, token_id in vocab.items():
            encoded[token_id] = token
        return encoded, hf.to_str()
    encoded = [tokenizer.id_to_token(i) or "" for i in range(vocab_size)]
    return encoded, None


def make_tokenizer_info(tokenizer: Any, vocab_size: int | None = None) -> TokenizerInfo:
    """xgrammar's view of a hearth tokenizer (byte-level BPE or SentencePiece byte-fallback).

    `vocab_size` is the model's (its logits row length): ids past the tokenizer's vocabulary are
    padded as never-allowed, tokenizer ids past the model's are dropped.
    """
    encoded, backend_json = _encoded_vocab(tokenizer)
    if vocab_size is not None:
        encoded = (encoded + [""] * vocab_size)[:vocab_size]
    if backend_json is not None:
        # xgrammar reads the vocab type (byte-level / byte-fallback / raw) from the tokenizer's
        # pre-tokenizer and decoder; that detection is not exposed under a public name.
        meta = TokenizerInfo._detect_metadata_from_hf(backend_json)
        vocab_type, add_prefix_space = meta["vocab_type"], meta["add_prefix_space"]
    else:
        vocab_type, add_prefix_space = xgr.VocabType.BYTE_LEVEL, False
    stop_ids = [int(i) for i in tokenizer.eos_token_ids if int(i) < len(encoded)] or None
    return xgr.TokenizerInfo(
        encoded,
        vocab_type,
        vocab_size=len(encoded),
        stop_token_ids=stop_ids,
        add_prefix_space=add_prefix_space,
    )


class Matcher:
    """The grammar state of one request. Not thread-safe; one per request."""

    def __init__(self, compiled: xgr.CompiledGrammar, vocab_size: int,
                 jump_forward: bool = True) -> None:
        self._matcher = xgr.GrammarMatcher(compiled)
        self._vocab_size = vocab_size
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)  # [1, ceil(vocab / 32)] int32
        self.jump_forward = jump_forward
        self._forced: deque[int] = deque()  # forced tokens not yet accepted
        self._history: list[tuple[int, ...]] = []  # _forced before each accepted token (rollback)

    def fill_mask(self, logits_row: torch.Tensor) -> None:
        """Set the logits of tokens the grammar forbids next to -inf, in place.

        `logits_row`: 1-D float tensor, [model_vocab_size] (>= or < the tokenizer's vocab).
        """
        if self._forced:  # exactly one token is allowed
            forced = self._forced[0]
            value = logits_row[forced].clone()
            logits_row.fill_(float("-inf"))
            logits_row[forced] = value
            return
        self._matcher.fill_next_token_bitmask(self._bitmask)
        num_known = min(self._vocab_size, logits_row.shape[-1])
        mask = self._bitmask.to(logits_row.device, non_blocking=True)
        if logits_row.dtype == torch.float32 and logits_row.is_contiguous():
            xgr.apply_token_bitmask_inplace(logits_row.view(1, -1), mask, vocab_size=num_known)
        else:  # the kernels take float32 rows; other dtypes go through a float32 scratch row
            scratch = torch.zeros(1, num_known, device=logits_row.device)
            xgr.apply_token_bitmask_inplace(scratch, mask, vocab_size=num_known)
            logits_row[:num_known].masked_fill_(scratch[0].isinf(), float("-inf"))
        if logits_row.shape[-1] > num_known:
            logits_row[num_known:] = float("-inf")

    def accept(self, token_id: int) -> bool:
        """Advance past `token_id`; False (state unchanged) if the grammar did not allow it."""
        if not 0 <= token_id < self._vocab_size:
            return False
        if self._forced and token_id != self._forced[0]:
            return False
        if not self._matcher.accept_token(int(token_id)):
            return False
        self._history.append(tuple(self._forced))
        if self._forced:
            self._forced.popleft()
        else:  # a sampled token: what does the grammar force after it?
            self._forced.extend(self._matcher.find_jump_forward_tokens())
        return True

    def forced_token_ids(self) -> list[int]:
        """With jump-forward: the tokens the grammar forces next (after the last sampled token),
        for the engine to append without sampling; each is then `accept`ed like any token.
        [] without jump-forward (the mask forces them, one per step) or when nothing is forced."""
        return list(self._forced) if self.jump_forward else []

    def accept_text(self, text: str) -> bool:
        """Advance past a string (tests only: it is one rollback step, not one per token)."""
        if not self._matcher.accept_string(text):
            return False
        self._forced.clear()
        self._history.append(())
        return True

    def is_terminated(self) -> bool:
        """True once the grammar is complete and a stop token was accepted."""
        return bool(self._matcher.is_terminated())

    def is_complete(self) -> bool:
        """True when the output so far is a full sentence of the grammar (EOS would be allowed)."""
        return bool(self._matcher.is_completed())

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (speculative decoding, PD first token)."""
        if num_tokens > 0:
            self._matcher.rollback(num_tokens)
            self._forced = deque(self._history[-num_tokens])
            del self._history[-num_tokens:]

    def allowed_token_ids(self) -> list[int]:
        """The ids allowed next (tests and debugging; slow on purpose-free paths)."""
        row = torch.zeros(self._vocab_size)
        self.fill_mask(row)
        return torch.nonzero(row == 0).flatten().tolist()


class GrammarCompiler:
    """Compiles guided specs for one tokenizer; compiled grammars are cached by xgrammar."""

    def __init__(self, tokenizer: Any, vocab_size: int | None = None, max_threads: int = 1) -> None:
        self._info = make_tokenizer_info(tokenizer, vocab_size)
        self._vocab_size = self._info.vocab_size
        self._compiler = xgr.GrammarCompiler(self._info, max_threads=max_threads)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def fork(self) -> GrammarCompiler:
        """A compiler sharing this one's vocabulary, for another thread (one xgrammar
        compiler per thread; the cache lives in `GrammarPool`, so xgrammar's is off)."""
        other = object.__new__(GrammarCompiler)
        other._info, other._vocab_size = self._info, self._vocab_size
        other._compiler = xgr.GrammarCompiler(self._info, max_threads=1, cache_enabled=False)
        return other

    def matcher(self, spec: GuidedSpec) -> Matcher:
        """A fresh matcher for `spec`. Raises ValueError naming what is wrong with the spec."""
        return Matcher(self.compile(spec), self._vocab_size)

    def compile(self, spec: GuidedSpec) -> xgr.CompiledGrammar:
        if spec.kind not in GUIDED_KINDS:
            raise ValueError(f"guided: unknown kind {spec.kind!r}; one of {', '.join(GUIDED_KINDS)}")
        try:
            return self._compile(spec)
        except ValueError:
            raise
        except Exception as exc:  # xgrammar raises RuntimeError / its own types for bad input
            raise ValueError(f"invalid {spec.kind}: {exc}") from exc

    def _compile(self, spec: GuidedSpec) -> xgr.CompiledGrammar:
        if spec.kind == "json_schema":
            schema = bounded_strings_as_patterns(parse_json_schema(spec.value))
            return self._compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
        if spec.kind == "json_object":
            return self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if spec.kind == "regex":
            return self._compiler.compile_regex(spec.value)
        if spec.kind == "grammar":
            if _looks_like_lark(spec.value):
                return self._compiler.compile_grammar(xgr.Grammar.from_lark(spec.value))
            return self._compiler.compile_grammar(spec.value)
        tag = json.loads(spec.value)
        _check_nested_schemas(tag)
        return self._compiler.compile_structural_tag(json.dumps(_fixed_separators(tag)))


def _check_nested_schemas(node: Any) -> None:
    """Structural tags embed JSON schemas; check each so a bad one is a clear ValueError."""
    if isinstance(node, dict):
        if node.get("type") == "json_schema" and "json_schema" in node:
            parse_json_schema(json.dumps(node["json_schema"]))
        for value in node.values():
            _check_nested_schemas(value)
    elif isinstance(node, list):
        for value in node:
            _check_nested_schemas(value)


def _fixed_separators(node: Any) -> Any:
    """A copy of a structural tag where each `json_schema` node with `separators` is a grammar
    node for that schema with exactly those separators and no other whitespace."""
    if isinstance(node, list):
        return [_fixed_separators(value) for value in node]
    if not isinstance(node, dict):
        return node
    if node.get("type") == "json_schema" and "separators" in node:
        comma, colon = node["separators"]
        grammar = xgr.Grammar.from_json_schema(
            json.dumps(node["json_schema"]), any_whitespace=False, separators=(comma, colon))
        return {"type": "grammar", "grammar": str(grammar)}
    return {key: _fixed_separators(value) for key, value in node.items()}


def _looks_like_lark(grammar: str) -> bool:
    # EBNF rules use "::="; Lark rules use ":" and a `start` rule.
    return "::=" not in grammar

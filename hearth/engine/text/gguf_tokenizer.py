"""GGUF tokenizer metadata -> a `tokenizers.Tokenizer` equivalent to the model's original tokenizer.

Invariant: the result encodes text exactly as the HF `tokenizer.json` the GGUF was converted from
(and as llama.cpp does): same vocabulary ids, same merges, same pre-tokenizer split, and every
CONTROL / USER_DEFINED token matched whole in the text.

A GGUF carries no tokenizer.json, only llama.cpp's description of it:
  tokenizer.ggml.model   "gpt2" (byte-level BPE) | "llama" (SentencePiece-style BPE with scores)
  tokenizer.ggml.pre     which pre-tokenizer regex the model was trained with (gpt2 models only)
  tokenizer.ggml.tokens / merges / scores / token_type, and the special token ids.
The `pre` name is the one piece that must be translated by hand: see `_PRE_TOKENIZERS`.
"""

from __future__ import annotations

import json
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

# llama.cpp token types (gguf.TokenType)
CONTROL, USER_DEFINED = 3, 4

_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
_BYTE_LEVEL_NO_REGEX = {**_BYTE_LEVEL, "use_regex": False}

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _split_then_bytes(*regexes: str) -> dict:
    """Each regex splits (isolating its matches) the pieces the one before left, then bytes."""
    splits = [{"type": "Split", "pattern": {"Regex": r}, "behavior": "Isolated", "invert": False}
              for r in regexes]
    return {"type": "Sequence", "pretokenizers": [*splits, _BYTE_LEVEL_NO_REGEX]}


# DeepSeek-V3 / R1 (llama.cpp's "deepseek-v3"): digits in threes, then CJK runs, then words and
# punctuation (as llama.cpp's LLAMA_VOCAB_PRE_TYPE_DEEPSEEK3_LLM splits them).
_DEEPSEEK_V3_SPLITS = (
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)


# Kimi K2 (llama.cpp's "kimi-k2"; the pattern of the model's own tiktoken tokenizer): Han runs
# alone, words whose letters exclude Han (character-class intersections, which the tokenizers
# library's Oniguruma regex supports as tiktoken's does), digits in threes, punctuation runs,
# newlines, spaces.
_KIMI_K2_SPLIT = "|".join((
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
))


_DIGITS_THEN_BYTES = {
    "type": "Sequence",
    "pretokenizers": [{"type": "Digits", "individual_digits": True}, _BYTE_LEVEL],
}
_NFC = {"type": "NFC"}

# tokenizer.ggml.pre -> (normalizer, pre_tokenizer, ignore_merges), as in each family's tokenizer.json
_PRE_TOKENIZERS: dict[str, tuple[dict | None, dict, bool]] = {
    "default": (None, _BYTE_LEVEL, False),
    "gpt2": (None, _BYTE_LEVEL, False),
    # StarCoder-family vocabularies (SmolLM, SmolLM2): digits are always split one by one first.
    # (transformers' GGUF loader omits this step; it changes e.g. "a  1" -> [a, Ġ, Ġ, 1] instead of
    # the original tokenizer's [a, ĠĠ, 1].)
    **{name: (None, _DIGITS_THEN_BYTES, False) for name in ("smollm", "starcoder", "refact", "codeshell")},
    **{
        name: (None, _split_then_bytes(_LLAMA3_SPLIT), True)
        for name in ("llama3", "llama-bpe", "llama-v3", "smaug-bpe", "falcon3")
    },
    **{name: (_NFC, _split_then_bytes(_QWEN2_SPLIT), False) for name in ("qwen2", "deepseek-r1-qwen")},
    "tekken": (None, _split_then_bytes(_TEKKEN_SPLIT), False),
    "deepseek-v3": (None, _split_then_bytes(*_DEEPSEEK_V3_SPLITS), False),
    # tiktoken looks a whole piece up in the vocabulary before merging (ignore_merges)
    "kimi-k2": (None, _split_then_bytes(_KIMI_K2_SPLIT), True),
}


def build_gguf_tokenizer(metadata: dict[str, Any]) -> HFTokenizer:
    """Build the tokenizer described by a GGUF file's `tokenizer.*` metadata."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind == "gpt2":
        spec = _byte_level_bpe(metadata)
    elif kind == "llama":
        spec = _sentencepiece_bpe(metadata)
    else:
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (supported: 'gpt2', 'llama')")
    spec["added_tokens"] = _added_tokens(metadata)
    spec["post_processor"] = _post_processor(metadata)
    spec.update(version="1.0", truncation=None, padding=None)
    return HFTokenizer.from_str(json.dumps(spec))


def _byte_level_bpe(metadata: dict[str, Any]) -> dict:
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        raise ValueError(
            f"GGUF pre-tokenizer {pre!r} is not supported (supported: {', '.join(sorted(_PRE_TOKENIZERS))})"
        )
    normalizer, pre_tokenizer, ignore_merges = _PRE_TOKENIZERS[pre]
    model = _bpe_model(metadata, merges=metadata["tokenizer.ggml.merges"], byte_fallback=False)
    model["ignore_merges"] = ignore_merges
    return {
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        "model": model,
        "decoder": {**_BYTE_LEVEL, "add_prefix_space": True},
    }


def _sentencepiece_bpe(metadata: dict[str, Any]) -> dict:
    """SentencePiece BPE (Llama 2, Mistral): "▁" marks spaces, <0xNN> tokens cover any byte."""
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    merges = metadata.get("tokenizer.ggml.merges") or _merges_from_scores(
        tokens, metadata["tokenizer.ggml.scores"]
    )
    model = _bpe_model(metadata, merges=merges, byte_fallback=True)
    unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
    model.update(fuse_unk=True, unk_token=tokens[unk_id] if unk_id is not None else None)
    prepend = "first" if metadata.get("tokenizer.ggml.add_space_prefix", True) else "never"
    return {
        "normalizer": None,
        "pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": prepend, "split": False},
        "model": model,
        "decoder": {
            "type": "Sequence",
            "decoders": [
                {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
                {"type": "ByteFallback"},
                {"type": "Fuse"},
                *([{"type": "Strip", "content": " ", "start": 1, "stop": 0}] if prepend == "first" else []),
            ],
        },
    }


def _bpe_model(metadata: dict[str, Any], merges: list, byte_fallback: bool) -> dict:
    vocab: dict[str, int] = {}
    for token_id, token in enumerate(metadata["tokenizer.ggml.tokens"]):
        vocab.setdefault(token, token_id)  # a few vocabularies repeat a placeholder string
    return {
        "type": "BPE",
        "dropout": None,
        "unk_token": None,
        "continuing_subword_prefix": None,
        "end_of_word_suffix": None,
        "fuse_unk": False,
        "byte_fallback": byte_fallback,
        "ignore_merges": False,
        "vocab": vocab,
        "merges": merges,  # "left right" strings, as llama.cpp stores them
    }


def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[list[str]]:
    """SentencePiece stores no merges: a token can be built from any split into two known tokens,
    and a higher-scored token is merged first."""
    ids = {token: i for i, token in reversed(list(enumerate(tokens)))}
    ranked: list[tuple[float, int, int, str, str]] = []
    for token, token_id in ids.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ids and right in ids:
                ranked.append((-scores[token_id], ids[left], ids[right], left, right))
    ranked.sort()
    return [[left, right] for *_, left, right in ranked]


def _added_tokens(metadata: dict[str, Any]) -> list[dict]:
    """CONTROL tokens are special (skipped on decode); USER_DEFINED ones (e.g. <think>) are plain
    added tokens. Both are matched whole in the text before the model splits it."""
    token_types = metadata.get("tokenizer.ggml.token_type") or []
    added = []
    for token_id, (token, token_type) in enumerate(zip(metadata["tokenizer.ggml.tokens"], token_types, strict=False)):
        if token_type in (CONTROL, USER_DEFINED) and token:
            added.append({
                "id": token_id, "content": token, "single_word": False, "lstrip": False,
                "rstrip": False, "normalized": False, "special": token_type == CONTROL,
            })
    return added


def _post_processor(metadata: dict[str, Any]) -> dict | None:
    """Add BOS/EOS around `encode(..., add_special_tokens=True)` where the file asks for them."""
    tokens = metadata["tokenizer.ggml.tokens"]
    wrap: dict[str, list[dict]] = {"bos": [], "eos": []}
    special_tokens: dict[str, dict] = {}
    for key in wrap:
        token_id = metadata.get(f"tokenizer.ggml.{key}_token_id")
        if metadata.get(f"tokenizer.ggml.add_{key}_token", False) and token_id is not None:
            token = tokens[token_id]
            wrap[key].append({"SpecialToken": {"id": token, "type_id": 0}})
            special_tokens[token] = {"id": token, "ids": [token_id], "tokens": [token]}
    if not special_tokens:
        return None
    single = [*wrap["bos"], {"Sequence": {"id": "A", "type_id": 0}}, *wrap["eos"]]
    pair = [*single, {"Sequence": {"id": "B", "type_id": 1}}]
    return {"type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": special_tokens}

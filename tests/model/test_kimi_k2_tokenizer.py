"""Kimi K2's tokenizer, from a GGUF (`tokenizer.ggml.pre = "kimi-k2"`) and from its HF folder
(tiktoken.model, no tokenizer.json), encodes as the model's own tiktoken tokenizer does.

Kimi K2 ships a tiktoken tokenizer (mergeable ranks + a split pattern with Han-excluding
character classes); llama.cpp's converter stores it in a GGUF as a byte-level BPE vocabulary
whose merges are recovered from the ranks. The real K2 vocabulary is not available offline, so
this test builds a tiktoken encoding with K2's pattern over ranks taken from the default model's
merges plus tokens for whole K2 pieces, converts it the way the converter does (tokens in rank order, each token's merge found by
running BPE on it with the ranks below its own), and checks that hearth's GGUF tokenizer and
tiktoken give the same ids on text that exercises every branch of the pattern.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
import regex

tiktoken = pytest.importorskip("tiktoken")

from hearth.engine.text.gguf_tokenizer import build_gguf_tokenizer  # noqa: E402
from hearth.engine.text.tokenizer import Tokenizer  # noqa: E402
from hearth.models.gguf_file import read_metadata  # noqa: E402
from hearth.models.loader import resolve_builtin  # noqa: E402

# The split pattern of Kimi K2's tiktoken tokenizer (a fact of the format, written out here
# independently of hearth's copy, which is in tokenizers' regex dialect).
KIMI_PATTERN = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
SPECIALS = ["<|im_end|>", "<|tool_calls_section_begin|>", "<|tool_call_begin|>"]
NUM_MERGES = 6000
CONTROL, NORMAL = 3, 1

TEXTS = [
    "I'm sure THEY'LL say it's fine, we'd've DONE it.",
    "camelCase HTTPServer getURLForID XMLHttpRequest",
    "Hello你好世界World's 123 more中文text",
    "こんにちは世界、カタカナとひらがな",
    "naïve café résumé Ünïcödé ΑΒΓ αβγ Привет мир",
    "1234567 3.14159 0xFF 1e-9 2026-12-05",
    "def f(x):\n    return x ** 2  # square\r\n\n\n\tindent\t\ttabs   trailing   \n",
    '{"city": "Paris", "days": [1, 2, 3]} <|im_end|> ok',
    "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0",
    "emoji 🙂🚀 and symbols ©®™ — “quotes” …",
    "   leading spaces and\u00a0nbsp\u3000ideographic space",
]


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable Latin-1 bytes stand for themselves, the other bytes
    for the code points from 256 up, in byte order (how byte-level GGUF vocabularies spell bytes)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


def _bpe(ranks: dict[bytes, int], token: bytes, max_rank: int) -> list[bytes]:
    """tiktoken's merge loop on one token, using only ranks below `max_rank`."""
    parts = [bytes([b]) for b in token]
    while True:
        best = None
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and rank < max_rank and (best is None or rank < best[1]):
                best = (i, rank)
        if best is None:
            return parts
        i = best[0]
        parts[i:i + 2] = [parts[i] + parts[i + 1]]


@pytest.fixture(scope="module")
def ranks() -> dict[bytes, int]:
    """K2-style mergeable ranks: the default model's first merges, then whole K2 pieces."""
    source = read_metadata(resolve_builtin("smollm2-135m-instruct"))
    to_byte = {c: b for b, c in bytes_to_unicode().items()}
    ranks: dict[bytes, int] = {bytes([b]): b for b in range(256)}
    for merge in source["tokenizer.ggml.merges"][:NUM_MERGES]:
        left, right = merge.split(" ")
        token = bytes(to_byte[c] for c in left + right)
        ranks.setdefault(token, len(ranks))
    # Then K2-shaped tokens: every piece K2's pattern cuts from the texts (split here by the
    # `regex` module, a third regex engine) becomes a token, reached by a chain of pair merges,
    # so a tokenizer that cuts the text elsewhere ("World's", digit triples, Han runs, a
    # punctuation run with its newlines) gets other ids.
    pieces = {piece.encode() for text in TEXTS
              for piece in regex.findall(KIMI_PATTERN, text, flags=regex.V1)}
    for piece in sorted(pieces):
        parts = _bpe(ranks, piece, len(ranks))
        while len(parts) > 1:
            parts = [parts[0] + parts[1], *parts[2:]]
            ranks.setdefault(parts[0], len(ranks))
    return ranks


@pytest.fixture(scope="module")
def pair(ranks):
    """(tiktoken encoding, hearth's tokenizer from the converted GGUF metadata)."""
    to_unicode = bytes_to_unicode()
    specials = {name: len(ranks) + i for i, name in enumerate(SPECIALS)}
    encoding = tiktoken.Encoding("kimi-k2-test", pat_str=KIMI_PATTERN, mergeable_ranks=ranks,
                                 special_tokens=specials)

    def unicode(token: bytes) -> str:
        return "".join(to_unicode[b] for b in token)

    tokens, merges = [], []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        tokens.append(unicode(token))
        if len(token) > 1:
            parts = _bpe(ranks, token, rank)
            assert len(parts) == 2, (token, parts)  # the converter's check too
            left, right = parts  # the merge that made it
            merges.append(f"{unicode(left)} {unicode(right)}")
    metadata = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "kimi-k2",
                "tokenizer.ggml.tokens": tokens + SPECIALS,
                "tokenizer.ggml.token_type": [NORMAL] * len(tokens) + [CONTROL] * len(SPECIALS),
                "tokenizer.ggml.merges": merges}
    return encoding, build_gguf_tokenizer(metadata)


@pytest.mark.parametrize("text", TEXTS)
def test_kimi_k2_gguf_tokenizer_encodes_as_its_tiktoken(pair, text):
    encoding, tokenizer = pair
    expected = encoding.encode(text, allowed_special="all")
    assert tokenizer.encode(text, add_special_tokens=False).ids == expected
    assert tokenizer.decode(expected, skip_special_tokens=False) == text


def test_kimi_k2_special_tokens_are_whole_and_skipped_on_decode(pair):
    encoding, tokenizer = pair
    ids = tokenizer.encode("a<|im_end|>b", add_special_tokens=False).ids
    assert encoding.encode("<|im_end|>", allowed_special="all")[0] in ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == "ab"


# ---- Kimi K2's HF folder: tiktoken.model + tokenization_kimi.py, no tokenizer.json ---------------

FOLDER_SPECIALS = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>",
                   4: "<|im_assistant|>", 7: "<|tool_calls_section_begin|>"}


def write_kimi_folder(folder: Path, ranks: dict[bytes, int], kimi: bool = True) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    lines = [f"{base64.b64encode(t).decode()} {r}" for t, r in sorted(ranks.items(),
                                                                     key=lambda kv: kv[1])]
    (folder / "tiktoken.model").write_text("\n".join(lines) + "\n")
    n = len(ranks)
    config = {"bos_token": "[BOS]", "eos_token": "<|im_end|>",
              "added_tokens_decoder": {str(n + i): {"content": c, "special": True}
                                       for i, c in FOLDER_SPECIALS.items()}}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    if kimi:  # the remote code's presence is what names the family (its text is not read)
        (folder / "tokenization_kimi.py").write_text("# Kimi's TikTokenTokenizer\n")
    return folder


@pytest.fixture(scope="module")
def kimi_folder(ranks, tmp_path_factory):
    """(the model's own tiktoken encoding as tokenization_kimi.py builds it, hearth's Tokenizer
    from the folder)."""
    folder = write_kimi_folder(tmp_path_factory.mktemp("kimi"), ranks)
    n = len(ranks)
    specials = {FOLDER_SPECIALS.get(i - n, f"<|reserved_token_{i}|>"): i
                for i in range(n, n + 256)}
    encoding = tiktoken.Encoding("kimi-k2-folder", pat_str=KIMI_PATTERN, mergeable_ranks=ranks,
                                 special_tokens=specials)
    return encoding, Tokenizer.from_folder(folder)


@pytest.mark.parametrize("text", TEXTS + ["[BOS]<|im_user|>hi<|im_end|><|reserved_token_%d|>"])
def test_kimi_k2_hf_folder_encodes_as_its_tiktoken(kimi_folder, ranks, text):
    encoding, tokenizer = kimi_folder
    text = text.replace("%d", str(len(ranks) + 200))
    assert tokenizer.encode(text) == encoding.encode(text, allowed_special="all")


def test_kimi_k2_hf_folder_special_ids_and_decoding(kimi_folder, ranks):
    encoding, tokenizer = kimi_folder
    n = len(ranks)
    assert tokenizer.bos_token_id == n and n + 2 in tokenizer.eos_token_ids
    assert tokenizer.vocab_size == n + 256
    ids = encoding.encode("a<|tool_calls_section_begin|>b", allowed_special="all")
    assert tokenizer.decode(ids, skip_special_tokens=False) == "a<|tool_calls_section_begin|>b"
    assert tokenizer.decode(ids) == "ab"


def test_a_tiktoken_folder_hearth_cannot_read_is_refused_clearly(ranks, tmp_path):
    other = write_kimi_folder(tmp_path / "other", ranks, kimi=False)
    with pytest.raises(ValueError, match="family hearth does not know"):
        Tokenizer.from_folder(other)
    broken = write_kimi_folder(tmp_path / "broken", {bytes([b]): b for b in range(256)})
    with open(broken / "tiktoken.model", "a") as f:
        f.write("not-base64!! 256\n")
    with pytest.raises(ValueError, match=r"tiktoken.model:257: not a 'base64-token rank' line"):
        Tokenizer.from_folder(broken)
    gap = write_kimi_folder(tmp_path / "gap", {**{bytes([b]): b for b in range(256)}, b"ab": 300})
    with pytest.raises(ValueError, match="ranks are not 0..256"):
        Tokenizer.from_folder(gap)

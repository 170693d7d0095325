"""IncrementalDetokenizer: safe deltas (no split characters, no possible stop-string starts),
exact stop handling across token boundaries, and bounded decode windows.

Uses a tiny byte-level BPE tokenizer built here (every byte is a token, plus a few merges), so
multi-byte characters really are split across tokens, as with real byte-level vocabularies.
"""

from __future__ import annotations

import random

from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

from hearth.engine.text.detokenizer import IncrementalDetokenizer
from hearth.engine.text.tokenizer import Tokenizer

MERGES = [("S", "T"), ("O", "P"), ("ST", "OP"), ("Ġ", "w"), ("o", "r"), ("Ġw", "or")]


def make_byte_tokenizer() -> Tokenizer:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    for left, right in MERGES:
        vocab[left + right] = len(vocab)
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=MERGES))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken("<|end|>", special=True, normalized=False)])
    return Tokenizer(backend, eos_token_ids=(backend.token_to_id("<|end|>"),))


def make_detokenizer(**kwargs) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(make_byte_tokenizer(), **kwargs)


def stream(detok: IncrementalDetokenizer, ids: list[int], chunk_sizes: list[int] | None = None) -> list[str]:
    """Push `ids` in chunks (default: one token at a time), then flush; return all deltas."""
    deltas, i = [], 0
    sizes = iter(chunk_sizes or [])
    while i < len(ids):
        n = next(sizes, 1)
        deltas.append(detok.push(ids[i : i + n]))
        i += n
    deltas.append(detok.flush())
    return deltas


def test_multibyte_characters_are_never_split() -> None:
    tok = make_byte_tokenizer()
    text = "héllo 日本語 ñ"
    ids = tok.encode(text)
    assert len(ids) > len(text)  # the non-ASCII characters really span several tokens
    deltas = stream(IncrementalDetokenizer(tok), ids)
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    assert "日" in deltas  # released as one piece, once its third byte arrived


def test_emoji_and_multi_codepoint_sequences() -> None:
    tok = make_byte_tokenizer()
    text = "ok 🤗👍🏽 👨‍👩‍👧 done"
    deltas = stream(IncrementalDetokenizer(tok), tok.encode(text))
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_output_does_not_depend_on_chunking() -> None:
    tok = make_byte_tokenizer()
    text = "naïve café — 🤗 STOP? no: 数字 123"
    ids = tok.encode(text)
    rng = random.Random(0)
    for _ in range(20):
        sizes = [rng.randint(1, 5) for _ in ids]
        detok = IncrementalDetokenizer(tok, stop=("STOPX",))
        assert "".join(stream(detok, ids, sizes)) == text
        assert detok.stopped_by is None


def test_stop_string_split_across_tokens() -> None:
    tok = make_byte_tokenizer()
    ids = tok.encode("Hello S") + tok.encode("TO") + tok.encode("P world")
    detok = IncrementalDetokenizer(tok, stop=("STOP",))
    deltas = [detok.push([i]) for i in ids]
    assert "".join(deltas) == "Hello "
    assert detok.stopped_by == "STOP"
    assert detok.push(tok.encode("more")) == "" and detok.flush() == ""


def test_possible_stop_prefix_is_held_then_released() -> None:
    tok = make_byte_tokenizer()
    detok = IncrementalDetokenizer(tok, stop=("STOP",))
    assert detok.push(tok.encode("Hi ST")) == "Hi "  # "ST" might begin "STOP"
    assert detok.push(tok.encode("O")) == ""
    assert detok.push(tok.encode("RM")) == "STORM"  # it did not
    assert detok.flush() == "" and detok.stopped_by is None


def test_stop_inside_one_token_at_the_first_token() -> None:
    tok = make_byte_tokenizer()
    ids = tok.encode("STOP")
    assert len(ids) == 1  # merged into a single token
    detok = IncrementalDetokenizer(tok, stop=("STOP",))
    assert detok.push(ids) == ""
    assert detok.stopped_by == "STOP"


def test_include_stop_str_in_output() -> None:
    tok = make_byte_tokenizer()
    detok = IncrementalDetokenizer(tok, stop=("STOP",), include_stop_str_in_output=True)
    assert "".join(stream(detok, tok.encode("abc STOP def"))) == "abc STOP"


def test_the_stop_string_that_completes_first_wins() -> None:
    tok = make_byte_tokenizer()
    for chunk_sizes in ([1] * 11, [11]):  # the same answer however the tokens arrive
        detok = IncrementalDetokenizer(tok, stop=("world", "lo w", "o wor"))
        assert "".join(stream(detok, tok.encode("hello world"), chunk_sizes)) == "hel"
        assert detok.stopped_by == "lo w"


def test_stop_string_with_multibyte_characters() -> None:
    tok = make_byte_tokenizer()
    detok = IncrementalDetokenizer(tok, stop=("終わり",))
    assert "".join(stream(detok, tok.encode("これで終わりです"))) == "これで"


def test_flush_releases_held_stop_prefix_and_broken_character() -> None:
    tok = make_byte_tokenizer()
    detok = IncrementalDetokenizer(tok, stop=("STOP",))
    assert detok.push(tok.encode("end ST")) == "end "
    assert detok.flush() == "ST"

    broken = tok.encode("日")[:2]  # two of its three bytes: the stream was cut mid-character
    detok = IncrementalDetokenizer(tok)
    assert detok.push(tok.encode("a") + broken) == "a"
    assert detok.flush() == "\ufffd"


def test_special_tokens_are_skipped_or_kept() -> None:
    tok = make_byte_tokenizer()
    ids = tok.encode("hi<|end|>")
    assert "".join(stream(IncrementalDetokenizer(tok), ids)) == "hi"
    kept = IncrementalDetokenizer(tok, skip_special_tokens=False)
    assert "".join(stream(kept, ids)) == "hi<|end|>"


def test_decode_window_stays_small() -> None:
    tok = make_byte_tokenizer()
    window_sizes: list[int] = []
    decode = tok.decode

    def counting_decode(ids: list[int], skip_special_tokens: bool = True) -> str:
        window_sizes.append(len(ids))
        return decode(ids, skip_special_tokens)

    tok.decode = counting_decode  # type: ignore[method-assign]
    text = "日本語のテキスト 🤗 " * 40
    ids = tok.encode(text)
    assert "".join(stream(IncrementalDetokenizer(tok, stop=("zzz",)), ids)) == text
    assert max(window_sizes) <= 8  # a few bytes of one character, never the whole history


def expected_output(full_text: str, stop: tuple[str, ...], include_stop: bool) -> tuple[str, str | None]:
    """The reference: the whole decoded text, cut at the stop string that ends first (the longest
    one on a tie)."""
    hits = sorted((full_text.find(s) + len(s), -len(s), s) for s in stop if s in full_text)
    if not hits:
        return full_text, None
    end, _, s = hits[0]
    at = end - len(s)
    return full_text[: at + (len(s) if include_stop else 0)], s


def test_random_streams_match_the_truncated_full_decode() -> None:
    tok = make_byte_tokenizer()
    rng = random.Random(1)
    pieces = ["a", "b", "S", "T", "O", "P", " ", "é", "日", "🤗", "\n", "<|end|>"]
    for _ in range(300):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 25)))
        ids = tok.encode(text)
        full = tok.decode(ids)
        stop = tuple(
            full[i : i + rng.randint(1, 4)] or "zz" for i in (rng.randrange(len(full) + 1) for _ in range(2))
        ) + ("ST", "日🤗")
        include = rng.random() < 0.5
        detok = IncrementalDetokenizer(tok, stop=stop, include_stop_str_in_output=include)
        deltas = stream(detok, ids, [rng.randint(1, 4) for _ in ids])
        expected, stopped_by = expected_output(full, stop, include)
        assert ("".join(deltas), detok.stopped_by) == (expected, stopped_by), (text, stop)
        assert all("\ufffd" not in d for d in deltas)

"""The GGUF `tokenizer.ggml.pre` names hearth translates into tokenizers' pre-tokenizers: the
DeepSeek-V3 family's three chained splits (digits in threes, CJK runs, words/punctuation)."""

from __future__ import annotations

import json

from tokenizers import Tokenizer

from hearth.engine.text.gguf_tokenizer import _PRE_TOKENIZERS


def pieces(name: str, text: str) -> list[str]:
    spec = {"version": "1.0", "pre_tokenizer": _PRE_TOKENIZERS[name][1],
            "model": {"type": "BPE", "vocab": {}, "merges": []}}
    tokenizer = Tokenizer.from_str(json.dumps(spec))
    return [p for p, _ in tokenizer.pre_tokenizer.pre_tokenize_str(text)]


def test_deepseek_v3_splits_digits_in_threes_cjk_runs_and_words():
    assert pieces("deepseek-v3", "Hello world12345 你好!x  \n\nfoo") == [
        "Hello", "Ġworld", "123", "45", "Ġ", "ä½łå¥½", "!x", "ĠĠĊĊ", "foo"]


def test_kimi_k2_splits_han_runs_from_words_and_digits_in_threes():
    # Han runs stand alone (words exclude Han letters, not kana), a word keeps its contraction
    assert pieces("kimi-k2", "Hello你好世界World's 12345 こんにちは世界") == [
        "Hello", "ä½łå¥½ä¸ĸçķĮ", "World's", "Ġ", "123", "45", "ĠãģĵãĤĵãģ«ãģ¡ãģ¯", "ä¸ĸçķĮ"]

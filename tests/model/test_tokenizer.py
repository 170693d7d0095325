"""Tokenizers built from GGUF metadata and HF folders, against transformers and sentencepiece.

The reference for the default model is transformers' own GGUF tokenizer, with one documented
correction: SmolLM2's original tokenizer.json (and llama.cpp's "smollm" pre-tokenizer) split
digits one by one *before* the byte-level regex; transformers' GGUF path omits that step, which
only changes text with a run of 2+ whitespace characters right before a digit.
"""

from __future__ import annotations

import io
import json
import random
from pathlib import Path

import gguf
import pytest
from tokenizers import Tokenizer as HFTokenizer, pre_tokenizers

from hearth.engine.text.chat_template import ChatTemplateError
from hearth.engine.text.detokenizer import IncrementalDetokenizer
from hearth.engine.text.tokenizer import Tokenizer
from hearth.models.loader import load_checkpoint, resolve_builtin

PARITY_TEXTS = [
    "Hello, world!", "hello world", " leading space", "trailing space ", "   three leading",
    "The year 2024 had 366 days; pi ≈ 3.14159.", "1234567890", "x=1+2*3/4-5", "v1.2.3-rc4",
    "def add(a, b):\n    return a + b\n", "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}',
    "<tool_call>\n{\"name\": \"f\"}\n</tool_call>", "SELECT * FROM users WHERE id = 42;",
    "naïve café résumé Ünïcödé", "日本語のテキストです。", "Привет, мир!", "مرحبا بالعالم", "한국어 텍스트",
    "emoji 🤗🚀👍🏽 and 👨‍👩‍👧 family", "tabs\tand\nnewlines\n\n\nend", "\r\n windows \r\n",
    "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n", "text<|endoftext|>more",
    "<|im_start|><|im_end|>", "<repo_name>hearth<file_sep>main.py", "I'm sure they'll've done it",
    "CamelCaseIdentifier snake_case_identifier kebab-case", "$100.00 (USD) @ 5% APR #hashtag",
    "a" * 100, "    indented\n        more", "mixed 12 spaces  before 34 digits   5",
    "a  1", "x =  5", "\n\n1. first item\n\n2. second", "",
]


@pytest.fixture(scope="module")
def smollm_tokenizer() -> Tokenizer:
    return Tokenizer.from_checkpoint(load_checkpoint("smollm2-135m-instruct"))


@pytest.fixture(scope="module")
def transformers_tokenizer():
    from transformers import AutoTokenizer

    path = resolve_builtin("smollm2-135m-instruct")
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def make_digits_corrected_reference(transformers_tokenizer) -> HFTokenizer:
    """transformers' GGUF tokenizer with the original tokenizer.json's pre-tokenizer."""
    reference = HFTokenizer.from_str(transformers_tokenizer.backend_tokenizer.to_str())
    reference.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    return reference


def test_default_tokenizer_matches_transformers(smollm_tokenizer: Tokenizer, transformers_tokenizer) -> None:
    reference = make_digits_corrected_reference(transformers_tokenizer)
    for text in PARITY_TEXTS:
        ids = smollm_tokenizer.encode(text)
        assert ids == reference.encode(text, add_special_tokens=False).ids, text
        if not any(ch.isspace() and nxt.isdigit() for ch, nxt in zip(text, text[1:], strict=False)):
            assert ids == transformers_tokenizer.encode(text, add_special_tokens=False), text
        assert smollm_tokenizer.decode(ids, skip_special_tokens=False) == text
        assert smollm_tokenizer.decode(ids) == transformers_tokenizer.decode(ids, skip_special_tokens=True)


def test_whitespace_run_before_digit_follows_the_original_tokenizer(smollm_tokenizer: Tokenizer) -> None:
    tok = smollm_tokenizer
    assert [tok.id_to_token(i) for i in tok.encode("a  1")] == ["a", "ĠĠ", "1"]
    assert [tok.id_to_token(i) for i in tok.encode("year 2024")] == ["year", "Ġ", "2", "0", "2", "4"]


def test_default_tokenizer_special_ids(smollm_tokenizer: Tokenizer, transformers_tokenizer) -> None:
    tok = smollm_tokenizer
    assert tok.vocab_size == 49152 and tok.bos_token_id == 1
    assert tok.eos_token_ids == (2,) and tok.id_to_token(2) == "<|im_end|>"
    assert tok.all_special_ids == tuple(range(17))
    assert set(transformers_tokenizer.all_special_ids) <= set(tok.all_special_ids)
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi")  # add_bos_token is false
    assert not tok.supports_tools_in_template


@pytest.mark.parametrize("messages", [
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "Hi"}],  # the template inserts its default system prompt
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
     {"role": "user", "content": "Bye 👋"}],
])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    smollm_tokenizer, transformers_tokenizer, messages, add_generation_prompt
) -> None:
    ours = smollm_tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    theirs = transformers_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours == theirs


def test_tools_template_matches_transformers(smollm_tokenizer, transformers_tokenizer) -> None:
    template = (
        "{% if tools %}<tools>{{ tools | tojson }}</tools>\n{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    tools = [{"type": "function", "function": {"name": "météo", "parameters": {"type": "object", "properties": {}}}}]
    messages = [{"role": "user", "content": "Weather?"}]
    tok = Tokenizer(smollm_tokenizer.backend, chat_template=template, eos_token_ids=(2,))
    assert tok.supports_tools_in_template
    ours = tok.apply_chat_template(messages, tools=tools)
    assert "météo" in ours  # tojson does not escape non-ASCII, like transformers
    assert ours == transformers_tokenizer.apply_chat_template(
        messages, tools=tools, chat_template=template, tokenize=False, add_generation_prompt=True
    )


def test_template_errors_are_chat_template_errors(smollm_tokenizer: Tokenizer) -> None:
    tok = Tokenizer(smollm_tokenizer.backend, chat_template="{{ raise_exception('no system role') }}")
    with pytest.raises(ChatTemplateError, match="no system role"):
        tok.apply_chat_template([{"role": "system", "content": "x"}])
    with pytest.raises(ChatTemplateError):  # list content where the template concatenates strings
        smollm_tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": "x"}]}])


def test_missing_template_falls_back_to_chatml(smollm_tokenizer: Tokenizer) -> None:
    tok = Tokenizer(smollm_tokenizer.backend)
    assert tok.chat_template is None
    assert tok.eos_token_ids == (2,)  # <|im_end|> ends a ChatML turn
    assert tok.apply_chat_template([{"role": "user", "content": "Hi"}]) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_from_folder_round_trip(tmp_path: Path, smollm_tokenizer: Tokenizer) -> None:
    smollm_tokenizer.backend.save(str(tmp_path / "tokenizer.json"))
    config = {"chat_template": smollm_tokenizer.chat_template, "bos_token": "<|im_start|>",
              "eos_token": {"content": "<|im_end|>"}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    tok = Tokenizer.from_folder(tmp_path)
    assert (tok.bos_token_id, tok.eos_token_ids) == (1, (2, 0))
    for text in PARITY_TEXTS:
        assert tok.encode(text) == smollm_tokenizer.encode(text)
    messages = [{"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(messages) == smollm_tokenizer.apply_chat_template(messages)
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    assert Tokenizer.from_folder(tmp_path).apply_chat_template(messages) == "Hi!"


def test_incremental_detokenizer_on_real_vocabulary(smollm_tokenizer: Tokenizer) -> None:
    tok = smollm_tokenizer
    text = "Sure! Here's 日本語 and 🤗 — done.<|im_end|>"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, stop=("done",), prompt_token_ids=tok.encode("<|im_start|>assistant\n"))
    deltas = [detok.push([i]) for i in ids] + [detok.flush()]
    assert "".join(deltas) == "Sure! Here's 日本語 and 🤗 — "
    assert detok.stopped_by == "done" and all("\ufffd" not in d for d in deltas)


# ---------------------------------------------------------------------------------------------
# SentencePiece-style ("llama") GGUF vocabularies


def make_sentencepiece_model():
    import sentencepiece as spm

    rng = random.Random(0)
    words = ("the quick brown fox jumps over lazy dog hello world tokenizer model serving fast agents "
             "tools call json python code def return value naïve café").split()
    lines = [" ".join(rng.choice(words) for _ in range(12)) + rng.choice([".", "!", " 123"]) for _ in range(3000)]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=500, model_type="bpe", byte_fallback=True,
        character_coverage=1.0, split_digits=True, user_defined_symbols=["<tool>"], minloglevel=2,
        allow_whitespace_only_pieces=True, remove_extra_whitespaces=False, normalization_rule_name="identity",
    )
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def make_sentencepiece_gguf(path: Path, sp) -> Path:
    """A GGUF holding `sp`'s vocabulary the way llama.cpp's converter writes it."""
    def token_type(i: int) -> int:
        if sp.is_unknown(i):
            return gguf.TokenType.UNKNOWN
        if sp.is_control(i):
            return gguf.TokenType.CONTROL
        if sp.is_byte(i):
            return gguf.TokenType.BYTE
        return gguf.TokenType.USER_DEFINED if sp.id_to_piece(i) == "<tool>" else gguf.TokenType.NORMAL

    n = sp.get_piece_size()
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in (("block_count", 1), ("context_length", 64), ("embedding_length", 32),
                       ("feed_forward_length", 64), ("attention.head_count", 2), ("attention.head_count_kv", 2)):
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_tokenizer_model("llama")
    writer.add_token_list([sp.id_to_piece(i) for i in range(n)])
    writer.add_token_scores([sp.get_score(i) for i in range(n)])
    writer.add_token_types([token_type(i) for i in range(n)])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


SPM_TEXTS = [
    "hello world", "the quick brown fox 123", "ünïcødé 日本 🤗", "tabs\tand\nnewlines\n\n", "x<tool>y",
    "return value!", "naïve café", "a", "trailing  ", "json python code", "0.5 + 12", "",
]


def test_sentencepiece_gguf_matches_transformers_and_sentencepiece(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    sp = make_sentencepiece_model()
    path = make_sentencepiece_gguf(tmp_path / "spm.gguf", sp)
    tok = Tokenizer.from_gguf(gguf.GGUFReader(str(path)))
    reference = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in SPM_TEXTS + ["  leading spaces", "<tool> first"]:
        ids = tok.encode(text)
        assert ids == reference.encode(text, add_special_tokens=False), text
        assert tok.encode(text, add_special_tokens=True) == reference.encode(text), text
        assert tok.decode(ids) == reference.decode(ids, skip_special_tokens=True), text
    # sentencepiece itself agrees too, except that it always adds the dummy-prefix "▁" (even
    # before leading spaces or a leading user-defined token), which HF's Metaspace does not.
    for text in SPM_TEXTS:
        assert tok.encode(text) == sp.encode(text), text

"""What the harmony e2e tests serve: harmony's special tokens, a chat template that marks a model
as a harmony one, a tiny random gpt-oss folder with a byte-level tokenizer, and `hearth serve`
started on such a model (test_harmony.py: the default model with harmony's tokens added;
test_gpt_oss_serve.py and test_harmony_clients.py: the gpt-oss folder, one server for both,
conftest.py's `gpt_oss_served`).

Random weights write random text, so tests force the output with a regex (vLLM's
`structured_outputs`, which hearth takes on all three APIs): `forced(...)` is an analysis message
and then a call or a final answer, in the markup the harmony parsers read."""

from __future__ import annotations

import json
from pathlib import Path

from tests.e2e.conftest import MODEL, Server, start_server

HARMONY_TOKENS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
                  "<|return|>", "<|call|>"]
ENDOFTEXT = "<|endoftext|>"
# Not used to render (hearth writes harmony itself): it only marks the model as a harmony one.
TEMPLATE = ("{% for m in messages %}<|start|>{{ m.role }}<|channel|>final<|message|>"
            "{{ m.content }}<|end|>{% endfor %}<|start|>assistant")
ANALYSIS = r"<\|channel\|>analysis<\|message\|>[a-z ]{3,24}<\|end\|><\|start\|>assistant"
CALL = (r"<\|channel\|>commentary to=functions\.get_weather <\|constrain\|>json<\|message\|>"
        r'\{"city":"[A-Z][a-z]{1,8}"\}<\|call\|>')
FINAL = r"<\|channel\|>final<\|message\|>[a-z ]{1,16}<\|return\|>"
FORCED = ANALYSIS + CALL  # reasoning, then a call of get_weather(city)
FORCED_ANSWER = ANALYSIS + FINAL  # reasoning, then the answer


def forced(regex: str) -> dict:
    """The request field that holds the output to `regex`."""
    return {"structured_outputs": {"regex": regex}}


def start_harmony_server(folder: Path, model: Path) -> Server:
    """`hearth serve` on a harmony model: the format, tool parser and reasoning parser all come
    from `auto`; no grammar under tool_choice auto, so a regex may force the whole output."""
    return start_server(folder, "--model", str(model), "--served-model-name", MODEL,
                        "--no-guided-auto-tools", "--num-kv-blocks", "256")


def stop_whole(server: Server) -> None:
    """Stop a server once it is idle; its KV pool must then be whole (no test leaked blocks)."""
    report = server.wait_idle_and_whole()
    server.stop()
    assert report["kv_pool_is_whole"] is True, report


def write_gpt_oss_folder(folder: Path) -> dict[str, int]:
    """A tiny random GptOssForCausalLM (sinks, a sliding layer, biased experts) and its
    tokenizer: one token per byte (byte-level BPE, no merges) plus harmony's special tokens;
    <|return|>, <|call|> and <|endoftext|> end generation, as in gpt-oss's generation config.
    Returns the special tokens' ids."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([*HARMONY_TOKENS, ENDOFTEXT])
    ids = {t: tokenizer.token_to_id(t) for t in (*HARMONY_TOKENS, ENDOFTEXT)}
    config = transformers.GptOssConfig(
        vocab_size=tokenizer.get_vocab_size(), hidden_size=64, intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=4096, sliding_window=64, num_local_experts=4,
        num_experts_per_tok=2, bos_token_id=None,
        eos_token_id=[ids["<|return|>"], ids["<|call|>"], ids[ENDOFTEXT]],
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                         "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 1024})
    torch.manual_seed(0)
    transformers.GptOssForCausalLM(config).to(torch.float32).save_pretrained(folder)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": TEMPLATE, "eos_token": "<|return|>"}))
    return ids

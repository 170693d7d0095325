"""`hearth serve` on a gpt-oss model: a tiny random GptOssForCausalLM folder (sinks, a sliding
layer, biased experts) whose byte-level tokenizer has harmony's special tokens and whose chat
template writes harmony channels, so `--chat-format auto` picks hearth's harmony renderer, the
tool parser `auto` the openai one and the reasoning parser openai_gptoss. Through the official
client, output forced by a regex (`structured_outputs`) into an analysis message and a tool call
comes back as reasoning_content and a tool call, streamed the same as not; the model's own
<|call|> ends the turn. A client that drops a stream midway costs nothing: the KV pool is whole
once the server is idle."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch

from tests.e2e.conftest import MODEL, start_server
from tests.e2e.test_harmony import FORCED, HARMONY_TOKENS, TEMPLATE
from tests.e2e.test_tools import ASK, TOOLS, assemble_stream

transformers = pytest.importorskip("transformers")

GREEDY = dict(model=MODEL, temperature=0)
ENDOFTEXT = "<|endoftext|>"


def write_gpt_oss_folder(folder: Path) -> dict[str, int]:
    """The model and its tokenizer: one token per byte (byte-level BPE, no merges) plus
    harmony's special tokens; <|return|>, <|call|> and <|endoftext|> end generation, as in
    gpt-oss's generation config. Returns the special tokens' ids."""
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


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt_oss_serve")
    ids = write_gpt_oss_folder(folder / "model")
    server = start_server(folder, "--model", str(folder / "model"), "--served-model-name", MODEL,
                          "--no-guided-auto-tools", "--num-kv-blocks", "256")
    yield server, ids
    report = server.wait_idle_and_whole()
    server.stop()
    assert report["kv_pool_is_whole"] is True, report


def test_the_prompt_is_harmony(served):
    server, ids = served
    body = {"model": MODEL, "messages": ASK, "tools": TOOLS}
    tokens = httpx.post(server.url + "/tokenize", json=body, timeout=60).json()["tokens"]
    assert max(tokens) <= ids[ENDOFTEXT]  # the folder's own byte-level tokenizer
    # system, developer (the tools), user, then the generation prompt; one token each
    assert tokens[0] == ids["<|start|>"] and tokens.count(ids["<|start|>"]) == 4
    assert tokens.count(ids["<|end|>"]) == 3 and ids["<|channel|>"] not in tokens


def test_reasoning_and_tool_call_streamed_and_not(served):
    server, _ = served
    client = server.client()
    kwargs = dict(messages=ASK, tools=TOOLS, max_tokens=160, reasoning_effort="low",
                  extra_body={"structured_outputs": {"regex": FORCED}}, **GREEDY)
    response = client.chat.completions.create(**kwargs)
    choice = response.choices[0]
    reasoning = choice.message.reasoning_content
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert reasoning and "<|" not in reasoning and 3 <= len(reasoning) <= 24
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert list(json.loads(call.function.arguments)) == ["city"]
    details = response.usage.completion_tokens_details
    assert 0 < details.reasoning_tokens < response.usage.completion_tokens

    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    streamed_reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or ""
                                 for c in chunks if c.choices)
    content, calls, reason = assemble_stream(iter(chunks))
    assert streamed_reasoning == reasoning and content == "" and reason == "tool_calls"
    assert (calls[0]["name"], calls[0]["arguments"]) == ("get_weather", call.function.arguments)


def test_a_stream_dropped_midway_frees_its_blocks(served):
    """Read a few chunks, close the connection; the fixture's teardown checks the pool."""
    server, _ = served
    stream = server.client().chat.completions.create(
        messages=ASK, tools=TOOLS, max_tokens=160, stream=True,
        extra_body={"structured_outputs": {"regex": FORCED}}, **GREEDY)
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    report = server.wait_idle_and_whole()
    assert report["kv_pool_is_whole"] is True, report


def test_a_bad_regex_is_a_400(served):
    server, _ = served
    reply = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": ASK, "structured_outputs": {"regex": "(unclosed"}})
    assert reply.status_code == 400, reply.text

"""The legacy Completions API, /tokenize, /detokenize, /metrics and /health."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import MODEL

PROMPT = "The capital of France is"


def test_completion_greedy_stream_equals_non_stream(client):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert "Paris" in full.choices[0].text and text == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens == 8
    assert full.choices[0].finish_reason == "length"
    assert all(c.object == "text_completion" for c in chunks)


def test_completion_token_prompt_batch_and_n(client, server):
    ids = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}, headers=server.headers()).json()
    by_ids = client.completions.create(model=MODEL, prompt=ids["tokens"], max_tokens=4, temperature=0)
    by_text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    response = client.completions.create(model=MODEL, prompt=[PROMPT, "Once upon a time"],
                                         max_tokens=4, temperature=0.8, seed=3, n=2)
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    other = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=1)
    assert response.usage.prompt_tokens == ids["count"] + other.usage.prompt_tokens  # once per prompt
    assert 4 <= response.usage.completion_tokens <= 16


def test_completion_echo_and_logprobs(client):
    echoed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, echo=True)
    assert echoed.choices[0].text.startswith(PROMPT)
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2)
    logprobs = response.choices[0].logprobs
    assert "".join(logprobs.tokens) == response.choices[0].text
    assert len(logprobs.token_logprobs) == 4 and all(len(t) <= 2 for t in logprobs.top_logprobs)
    assert logprobs.text_offset[0] == 0


def test_tokenize_detokenize_round_trip(server):
    headers = server.headers()
    tokens = httpx.post(server.url + "/tokenize", json={"prompt": "Hello, world!"}, headers=headers).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0 and tokens["max_model_len"] > 0
    text = httpx.post(server.url + "/detokenize", json={"tokens": tokens["tokens"]}, headers=headers).json()
    assert text["prompt"] == "Hello, world!"
    chat = httpx.post(server.url + "/tokenize", headers=headers,
                      json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["count"] > tokens["count"]  # the template adds its markers


def test_health_and_metrics(server, client):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    text = httpx.get(server.url + "/metrics").text
    for name in ("hearth:time_to_first_token_seconds_bucket", "hearth:inter_token_latency_seconds_bucket",
                 "hearth:e2e_request_latency_seconds_count", "hearth:prompt_tokens_total",
                 "hearth:generation_tokens_total", "hearth:prefix_cache_hits_total",
                 "hearth:request_success_total", "hearth:num_requests_running",
                 "hearth:num_requests_waiting", "hearth:kv_cache_usage_perc"):
        assert name in text, name
    assert f'model_name="{MODEL}"' in text


def test_metrics_say_where_each_ttft_went(server, client):
    """A finished request adds one sample to each part of its TTFT (docs/api.md)."""
    parts = ("request_prompt_chunks_seconds", "request_first_step_seconds",
             "request_first_step_tokens", "request_ttft_outside_engine_seconds")

    def counts() -> dict[str, float]:
        text = httpx.get(server.url + "/metrics").text
        samples = {s.name: s.value for family in text_string_to_metric_families(text)
                   for s in family.samples}
        return {name: samples.get(f"hearth:{name}_count", 0.0) for name in parts}

    before = counts()
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                   max_tokens=2)
    after = counts()
    assert all(after[name] >= before[name] + 1 for name in parts), (before, after)


def test_metrics_gateway_inference_extension_names(server, client):
    """The model server protocol's vLLM names carry the same values as hearth's gauges."""
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1000, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))  # a first token: the request runs and holds KV blocks
    text = httpx.get(server.url + "/metrics").text
    stream.close()
    samples = {s.name: s for family in text_string_to_metric_families(text) for s in family.samples}
    for vllm_name, hearth_name in (("vllm:num_requests_waiting", "hearth:num_requests_waiting"),
                                   ("vllm:num_requests_running", "hearth:num_requests_running"),
                                   ("vllm:kv_cache_usage_perc", "hearth:kv_cache_usage_perc"),
                                   ("vllm:gpu_cache_usage_perc", "hearth:kv_cache_usage_perc")):
        assert samples[vllm_name].labels == {"model_name": MODEL}
        assert samples[vllm_name].value == samples[hearth_name].value, vllm_name
    assert samples["vllm:num_requests_running"].value == 1
    assert samples["vllm:num_requests_waiting"].value == 0
    assert 0 < samples["vllm:kv_cache_usage_perc"].value < 1
    report = server.load()
    cache_info = samples["vllm:cache_config_info"]
    assert cache_info.value == 1
    assert cache_info.labels == {"block_size": str(report["block_size"]),
                                 "num_gpu_blocks": str(report["num_total_blocks"])}
    lora_info = samples["vllm:lora_requests_info"]
    assert lora_info.labels == {"max_lora": "0", "running_lora_adapters": "",
                                "waiting_lora_adapters": ""}
    assert lora_info.value > 1.6e9  # a unix time: the picker keeps the newest series


def test_load_report_fields(server):
    report = server.load(check_pool=True)
    for field in ("num_running", "num_waiting", "num_free_blocks", "num_total_blocks",
                  "num_prefill_tokens_inflight", "num_decode_tokens_active", "kv_pool_is_whole"):
        assert field in report

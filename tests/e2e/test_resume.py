"""`return_token_ids` and the resume hop through real `hearth serve` processes, with the openai SDK.

The session's monolithic worker (conftest.py `server`) answers most of it; a prefill and a
decode worker (started for this module) show the PD rules: a decode hop's `token_ids` leave out
the first token (the prefill hop's response carries it), a decode worker takes a resume hop, a
prefill worker refuses one. Every test leaves its worker idle with the KV pool whole.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from hearth.api.pd_protocol import decode_request_field, resume_hop
from tests.e2e.conftest import MODEL, start_servers, stop_all
from tests.e2e.test_tools import ASK, TOOLS, check_call

GREEDY = dict(model=MODEL, temperature=0)
ASK_CAT = [{"role": "user", "content": "Tell me about cats in two sentences."}]
SCHEMA = {"type": "object", "properties": {  # bounded: a sampled output always closes in time
    "name": {"type": "string", "maxLength": 20}, "city": {"type": "string", "maxLength": 20}},
    "required": ["name", "city"], "additionalProperties": False}
JSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
PD_FLAGS = ("--num-kv-blocks", "256", "--kv-secret", "resume-test-secret")


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    prefill, decode = start_servers(tmp_path_factory.mktemp("resume-pd"),
                                    ("--role", "prefill", *PD_FLAGS), ("--role", "decode", *PD_FLAGS))
    yield prefill, decode
    stop_all(prefill, decode)


def stream_chat(client, **kwargs) -> dict:
    """A streamed chat answer, chunk by chunk: content, tool calls, ids, logprob entries."""
    out = dict(content="", calls={}, ids=[], prompt_ids=None, finish=None, usage=None,
               id_chunks=[], logprob_counts=[], text_chunks=[])
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True},
                                                **kwargs):
        if chunk.usage is not None:
            out["usage"] = chunk.usage
        if (chunk.model_extra or {}).get("prompt_token_ids") is not None:
            assert out["prompt_ids"] is None  # once: on the role chunk
            out["prompt_ids"] = chunk.model_extra["prompt_token_ids"]
        for choice in chunk.choices:
            ids = (choice.model_extra or {}).get("token_ids")
            if choice.delta.role is None:
                assert ids is not None  # every chunk but the role chunk carries its ids
                out["ids"] += ids
                out["id_chunks"].append(ids)
                out["logprob_counts"].append(len(choice.logprobs.content) if choice.logprobs else 0)
                out["text_chunks"].append(choice.delta.content or [])
            out["content"] += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                call = out["calls"].setdefault(delta.index, {"name": "", "arguments": ""})
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
            out["finish"] = choice.finish_reason or out["finish"]
    return out


def assert_whole(*servers) -> None:
    for server in servers:
        report = server.wait_idle_and_whole()
        assert report["num_requests_inflight"] == 0 and report["kv_pool_is_whole"] is True


def test_token_ids_are_off_by_default(server, client):
    body = dict(model=MODEL, messages=ASK_CAT, max_tokens=4, temperature=0)
    plain = httpx.post(server.base_url + "/chat/completions", json=body, headers=server.headers(),
                       timeout=120).json()
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]
    with httpx.stream("POST", server.base_url + "/completions", headers=server.headers(),
                      json={"model": MODEL, "prompt": "Hi", "max_tokens": 3, "stream": True},
                      timeout=120) as response:
        text = response.read().decode()
    assert "token_ids" not in text


def test_chat_stream_token_ids_concatenate_to_the_output(server, client):
    opening = client.chat.completions.create(messages=ASK_CAT, max_tokens=6, **GREEDY)
    # a stop string the output starts like, so the detokenizer holds its first words back:
    # their outputs have ids but no text yet
    held = " ".join(opening.choices[0].message.content.split()[:3]) + " qqq"
    kwargs = dict(messages=ASK_CAT, max_tokens=40, logprobs=True, top_logprobs=1,
                  stop=[held], extra_body={"return_token_ids": True}, **GREEDY)
    whole = client.chat.completions.create(**kwargs)
    streamed = stream_chat(client, **kwargs)
    assert [] in streamed["text_chunks"][:3]  # an id chunk came before its text
    extra = whole.model_extra
    assert streamed["prompt_ids"] == extra["prompt_token_ids"]
    assert streamed["ids"] == whole.choices[0].model_extra["token_ids"]
    assert len(streamed["ids"]) == whole.usage.completion_tokens == streamed["usage"].completion_tokens
    assert len(extra["prompt_token_ids"]) == whole.usage.prompt_tokens
    assert streamed["content"] == whole.choices[0].message.content
    # logprob entries travel with their ids, chunk by chunk
    assert streamed["logprob_counts"] == [len(ids) for ids in streamed["id_chunks"]]
    assert_whole(server)


def test_completions_token_ids_per_choice(server, client):
    kwargs = dict(model=MODEL, prompt=["The sky is", "Water is"], max_tokens=8, temperature=0,
                  extra_body={"return_token_ids": True})
    whole = client.completions.create(**kwargs)
    ids, prompts = {0: [], 1: []}, {}
    for chunk in client.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            extra = choice.model_extra
            ids[choice.index] += extra["token_ids"]
            if "prompt_token_ids" in extra:
                assert choice.index not in prompts
                prompts[choice.index] = extra["prompt_token_ids"]
    for choice in whole.choices:
        assert ids[choice.index] == choice.model_extra["token_ids"]
        assert prompts[choice.index] == choice.model_extra["prompt_token_ids"]
    assert whole.choices[0].model_extra["prompt_token_ids"] != prompts[1]
    assert_whole(server)


@pytest.mark.parametrize("k, with_prompt", [(1, True), (7, False), (20, True)])
def test_greedy_resume_streams_the_same_output(server, client, k, with_prompt):
    kwargs = dict(messages=ASK_CAT, max_tokens=30, **GREEDY)
    first = stream_chat(client, extra_body={"return_token_ids": True}, **kwargs)
    hop = resume_hop(first["ids"][:k], first["prompt_ids"] if with_prompt else None)
    resumed = stream_chat(client, extra_body={"return_token_ids": True, "kv_transfer": hop},
                          **kwargs)
    assert resumed["ids"] == first["ids"] and resumed["content"] == first["content"]
    assert resumed["id_chunks"][0] == first["ids"][:k]  # the given ids come back first
    assert resumed["finish"] == first["finish"] == "length"
    assert resumed["usage"].completion_tokens == 30
    assert resumed["usage"].prompt_tokens == first["usage"].prompt_tokens
    assert_whole(server)


def test_sampled_tool_call_resumed_inside_the_arguments(server, client):
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", temperature=1.0,
                  max_tokens=120)
    first = stream_chat(client, seed=5, extra_body={"return_token_ids": True}, **kwargs)
    [call] = first["calls"].values()
    check_call(call["name"], call["arguments"])
    cut = None  # one token into the arguments (found with the worker's /detokenize)
    for i in range(1, len(first["ids"])):
        text = httpx.post(server.url + "/detokenize", headers=server.headers(), timeout=30,
                          json={"model": MODEL, "tokens": first["ids"][:i]}).json()["prompt"]
        if '"arguments": {' in text or '"arguments":{' in text:
            cut = i + 1
            break
    assert cut is not None and cut < len(first["ids"])
    resumed = stream_chat(client, seed=6, extra_body={
        "return_token_ids": True, "kv_transfer": resume_hop(first["ids"][:cut])}, **kwargs)
    assert resumed["ids"][:cut] == first["ids"][:cut]
    [again] = resumed["calls"].values()
    assert again["name"] == call["name"] and resumed["finish"] == "tool_calls"
    check_call(again["name"], again["arguments"])
    assert_whole(server)


def test_json_schema_resumed_mid_object(server, client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "A person as JSON."}],
                  response_format=JSON_FORMAT, temperature=1.0, max_tokens=100)
    first = stream_chat(client, seed=3, extra_body={"return_token_ids": True}, **kwargs)
    assert first["finish"] == "stop"
    jsonschema.validate(json.loads(first["content"]), SCHEMA)
    cut = len(first["ids"]) // 2
    resumed = stream_chat(client, seed=4, extra_body={
        "return_token_ids": True, "kv_transfer": resume_hop(first["ids"][:cut])}, **kwargs)
    assert resumed["ids"][:cut] == first["ids"][:cut] and resumed["finish"] == "stop"
    jsonschema.validate(json.loads(resumed["content"]), SCHEMA)
    assert_whole(server)


def post(server, body: dict, path: str = "/chat/completions") -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, headers=server.headers(), timeout=120)


def test_malformed_resume_hops_are_400s_and_the_worker_carries_on(server, client):
    body = dict(model=MODEL, messages=ASK_CAT, max_tokens=8, temperature=0)
    ids = stream_chat(client, extra_body={"return_token_ids": True}, **body)["ids"]
    brace = 90  # any token but '{' is refused first by a json_schema grammar
    cases = [
        ({"role": "resume", "output_token_ids": "1 2"}, {}, "kv_transfer", None),
        ({"role": "resume", "output_token_ids": [1.5]}, {}, "kv_transfer", None),
        ({"role": "resume", "output_token_ids": [1], "extra": 1}, {}, "kv_transfer", None),
        ({"role": "resume", "output_token_ids": [10**6]}, {}, "kv_transfer.output_token_ids", None),
        (resume_hop(ids + ids[:1]), {}, "kv_transfer.output_token_ids", None),  # > max_tokens
        (resume_hop(ids[:1] * 9000), {"max_tokens": None}, "kv_transfer.output_token_ids",
         "context_length_exceeded"),
        (resume_hop([brace]), {"response_format": JSON_FORMAT}, "kv_transfer.output_token_ids",
         None),
        (resume_hop(ids[:2]), {"n": 2}, "n", None),
        (resume_hop(ids[:2], [10**6]), {}, "kv_transfer.prompt_token_ids", None),
    ]
    for hop, changes, param, code in cases:
        response = post(server, {**body, **changes, "kv_transfer": hop})
        error = response.json()["error"]
        assert response.status_code == 400, error
        assert (error["param"], error["code"]) == (param, code), error
        assert_whole(server)
    again = stream_chat(client, extra_body={"return_token_ids": True}, **body)
    assert again["ids"] == ids


def test_pd_decode_hop_token_ids_exclude_the_first_token(pd, server, client):
    prefill, decode = pd
    body = dict(model=MODEL, messages=ASK_CAT, temperature=0, return_token_ids=True)
    reference = stream_chat(client, max_tokens=12, extra_body={"return_token_ids": True},
                            **{k: v for k, v in body.items() if k != "return_token_ids"})
    first = post(prefill, {**body, "max_tokens": 1,
                           "kv_transfer": {"role": "prefill", "transfer_id": "resume-t1"}}).json()
    assert first["choices"][0]["token_ids"] == reference["ids"][:1]
    assert first["prompt_token_ids"] == first["kv_transfer"]["prompt_token_ids"]
    hop = decode_request_field(first["kv_transfer"])
    rest = stream_chat(decode.client(), max_tokens=12, extra_body={
        "return_token_ids": True, "kv_transfer": hop},
        **{k: v for k, v in body.items() if k != "return_token_ids"})
    assert rest["prompt_ids"] == first["prompt_token_ids"]
    assert first["choices"][0]["token_ids"] + rest["ids"] == reference["ids"]
    # the decode worker resumes too; a prefill worker refuses a resume hop
    resumed = stream_chat(decode.client(), max_tokens=12, extra_body={
        "return_token_ids": True, "kv_transfer": resume_hop(reference["ids"][:5])},
        **{k: v for k, v in body.items() if k != "return_token_ids"})
    assert resumed["ids"] == reference["ids"]
    refused = post(prefill, {**body, "max_tokens": 12, "kv_transfer": resume_hop([1])})
    assert refused.status_code == 400 and "role is 'prefill'" in refused.json()["error"]["message"]
    assert_whole(prefill, decode, server)

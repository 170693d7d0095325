"""The Responses and Messages APIs through `hearth up --prefill 1 --decode 1` on the default model:
the router translates them into its chat pipeline, so each request takes the PD path (prefill
hop, KV transfer, decode hop, stitched), and the output equals a monolithic worker's (greedy).
After each test both workers are idle and their pools whole."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

from tests.e2e.conftest import MODEL, wait_for
from tests.e2e.test_responses_api import ASK, TOOLS
from tests.e2e.test_tools import SCHEMAS
from tests.e2e.test_up import CLIENT_KEY, environ, start_up, worker_pids, worker_url

GREEDY = dict(model=MODEL, temperature=0)
ANTHROPIC_TOOLS = [{"name": t["name"], "description": t["description"], "input_schema": t["parameters"]}
                   for t in TOOLS]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    stack = start_up(tmp_path_factory.mktemp("up-front-doors"), MODEL, "--prefill", "1", "--decode", "1",
                     "--num-kv-blocks", "256", "--kv-lease-seconds", "15",
                     env={"HEARTH_API_KEY": CLIENT_KEY})
    yield stack
    stack.stop()


def workers(stack) -> dict[str, tuple[str, dict]]:
    """role -> (url, auth headers) of each worker the stack supervises."""
    out = {}
    for role in ("prefill", "decode"):
        [pid] = worker_pids(stack, role)
        out[role] = (worker_url(pid), {"Authorization": f"Bearer {environ(pid)['HEARTH_API_KEY']}"})
    return out


def load(worker: tuple[str, dict]) -> dict:
    url, headers = worker
    return httpx.get(url + "/load", params={"check_pool": "true"}, headers=headers, timeout=30).json()


@pytest.fixture
def pd(stack, server):
    """(stack, transferred-tokens counter): asserts the request really crossed prefill -> decode."""
    decode = workers(stack)["decode"]
    before = load(decode)["num_transferred_tokens"]
    yield stack, lambda: load(decode)["num_transferred_tokens"] - before
    # (a lease left by a decode hop that never came expires in 15 s: short, but not so short
    # that a decode hop slowed by `make test`'s other worker finds it gone and recomputes)
    for worker in workers(stack).values():
        wait_for(lambda: idle_and_whole(load(worker)), "worker idle, pool whole", stack.log_path, 60)


def idle_and_whole(report: dict) -> bool:
    return report["num_requests_inflight"] == 0 and report["kv_pool_is_whole"] is True


def test_responses_through_pd_equal_a_monolithic_worker(pd, server):
    stack, transferred = pd
    routed, single = stack.client(), server.client()
    fields = dict(input=ASK, tools=TOOLS, tool_choice="required", max_output_tokens=80, **GREEDY)
    first = routed.responses.create(**fields)
    assert transferred() > 0
    reference = single.responses.create(**fields)
    [call] = [i for i in first.output if i.type == "function_call"]
    [ref_call] = [i for i in reference.output if i.type == "function_call"]
    assert (call.name, call.arguments) == (ref_call.name, ref_call.arguments)
    jsonschema.validate(json.loads(call.arguments), SCHEMAS["get_weather"])
    assert first.usage.input_tokens == reference.usage.input_tokens
    # the follow-up sends only the tool's output; the router's store has the rest
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"forecast": "sunny"}'}
    events = list(routed.responses.create(previous_response_id=first.id, input=[result], tools=TOOLS,
                                          max_output_tokens=16, stream=True, **GREEDY))
    final = events[-1].response
    ref_result = {**result, "call_id": ref_call.call_id}
    ref_follow = single.responses.create(previous_response_id=reference.id, input=[ref_result],
                                         tools=TOOLS, max_output_tokens=16, **GREEDY)
    assert events[0].type == "response.created" and final.status in ("completed", "incomplete")
    assert final.output_text == ref_follow.output_text
    assert final.usage.input_tokens == ref_follow.usage.input_tokens
    assert final.usage.input_tokens_details.cached_tokens > 0  # the first turn was cached


def test_messages_through_pd_equal_a_monolithic_worker(pd, server):
    stack, transferred = pd
    routed = anthropic.Anthropic(base_url=stack.url, api_key=CLIENT_KEY, max_retries=0, timeout=120)
    single = anthropic.Anthropic(base_url=server.url, api_key=server.api_key, max_retries=0, timeout=120)
    # (not the previous test's prompt: the decode worker holds that one, so the router, aware of
    # its cache, would rightly skip the prefill hop)
    ask = "What will the weather be in Rome for the next 5 days?"
    fields = dict(model=MODEL, max_tokens=80, messages=[{"role": "user", "content": ask}],
                  tools=ANTHROPIC_TOOLS, tool_choice={"type": "any"}, extra_body={"temperature": 0})
    with routed.messages.stream(**fields) as stream:
        message = stream.get_final_message()
    assert transferred() > 0
    reference = single.messages.create(**fields)
    [call], [ref_call] = ([b for b in m.content if b.type == "tool_use"] for m in (message, reference))
    assert (call.name, call.input) == (ref_call.name, ref_call.input)
    assert message.stop_reason == reference.stop_reason == "tool_use"
    assert message.usage.output_tokens == reference.usage.output_tokens
    counted = routed.messages.count_tokens(model=MODEL, messages=fields["messages"], tools=ANTHROPIC_TOOLS)
    assert counted.input_tokens == reference.usage.input_tokens + reference.usage.cache_read_input_tokens


def test_errors_through_the_stack_keep_each_apis_shape(pd):
    stack, _ = pd
    headers = {"x-api-key": CLIENT_KEY, "anthropic-version": "2023-06-01"}
    bad = httpx.post(stack.url + "/v1/messages", headers=headers, timeout=30,
                     json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]})
    assert bad.status_code == 400 and bad.json()["type"] == "error"
    assert bad.json()["error"]["type"] == "invalid_request_error"
    too_long = httpx.post(stack.url + "/v1/messages", headers=headers, timeout=30, json={
        "model": MODEL, "max_tokens": 100000, "messages": [{"role": "user", "content": "Hi"}]})
    assert too_long.status_code == 400 and "context length" in too_long.json()["error"]["message"]
    # refused before the prefill hop (on the router's tokenization): no KV lease left behind
    assert load(workers(stack)["prefill"])["num_leases_active"] == 0
    wrong_key = httpx.post(stack.url + "/v1/messages", headers={**headers, "x-api-key": "wrong"},
                           timeout=30, json={"model": MODEL, "max_tokens": 5,
                                             "messages": [{"role": "user", "content": "Hi"}]})
    assert wrong_key.status_code == 401 and wrong_key.json()["error"]["type"] == "authentication_error"
    missing = httpx.post(stack.url + "/v1/responses", timeout=30,
                         headers={"Authorization": f"Bearer {CLIENT_KEY}"},
                         json={"model": MODEL, "input": "Hi", "previous_response_id": "resp_nope"})
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "previous_response_not_found"

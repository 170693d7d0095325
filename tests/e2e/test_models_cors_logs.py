"""Issue 9 at the edge, with the official openai client against real processes: model aliases
and 404 model_not_found (worker and router), CORS preflight, the access log, a tool call cut off
by max_tokens (finish_reason "length", no markup in content), jump-forward parity (a worker
with --no-jump-forward gives the same call), and a quiet shutdown."""

from __future__ import annotations

import os
import signal
import time

import httpx
import openai
import pytest

from tests.e2e.conftest import Server, start_router, start_server, wait_for
from tests.e2e.test_tools import assemble_stream

NAMES = ("smol", "gpt-4o-mini")
ORIGIN = "http://localhost:3000"
KEY = "edge-key"
READ_FILE = {"type": "function", "function": {
    "name": "read_file", "description": "Read a file of the repository.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                   "required": ["path"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "Show me the file src/main.py."}]
NAMED = {"type": "function", "function": {"name": "read_file"}}
SMALL = ("--num-kv-blocks", "128")


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("edge"), "--served-model-name", *NAMES,
                       "--allowed-origins", ORIGIN, *SMALL, api_key=KEY)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def router(tmp_path_factory, worker):
    srv = start_router(tmp_path_factory.mktemp("edge-router"), "--worker", worker.url,
                       "--worker-api-key", KEY, "--served-model-name", "routed", "agent-default",
                       "--allowed-origins", "*")
    yield srv
    srv.stop()


def test_models_lists_every_alias_and_retrieves_each(worker):
    client = worker.client()
    assert [m.id for m in client.models.list()] == list(NAMES)
    assert client.models.retrieve("gpt-4o-mini").id == "gpt-4o-mini"
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("gpt-5")
    assert err.value.code == "model_not_found"
    assert err.value.body["type"] == "invalid_request_error"


def test_any_alias_is_accepted_and_an_unknown_model_is_404(worker):
    client = worker.client()
    reply = client.chat.completions.create(model="gpt-4o-mini", messages=ASK, max_tokens=3)
    assert reply.model == "smol"  # responses carry the primary name
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-5", messages=ASK, max_tokens=3)
    assert err.value.code == "model_not_found" and "gpt-5" in err.value.message
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-5", prompt="Hi", max_tokens=3)


def test_router_serves_its_own_names_and_rewrites_them_for_the_worker(router):
    client = router.client()
    assert [m.id for m in client.models.list()] == ["routed", "agent-default"]
    assert client.models.retrieve("agent-default").id == "agent-default"
    reply = client.chat.completions.create(model="agent-default", messages=ASK, max_tokens=3)
    assert reply.usage.completion_tokens == 3
    for bad in ("smol", "gpt-5"):  # the worker's names are not the router's
        with pytest.raises(openai.NotFoundError) as err:
            client.chat.completions.create(model=bad, messages=ASK, max_tokens=3)
        assert err.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("smol")


@pytest.mark.parametrize("which", ["worker", "router"])
def test_cors_preflight_is_answered_without_credentials(request, which):
    srv: Server = request.getfixturevalue(which)
    response = httpx.options(srv.url + "/v1/chat/completions", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"}, timeout=10)
    assert response.status_code == 200
    assert response.headers["access-control-allow-origin"] in (ORIGIN, "*")
    listed = httpx.get(srv.base_url + "/models", headers={"Origin": ORIGIN, **srv.headers()})
    assert listed.headers["access-control-allow-origin"] in (ORIGIN, "*")


def test_cors_is_off_without_the_flag(server):
    response = httpx.options(server.url + "/v1/chat/completions", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST"}, timeout=10)
    assert response.status_code == 405
    assert "access-control-allow-origin" not in response.headers


def test_one_access_line_per_request_through_router_and_worker(router, worker):
    client = router.client(default_headers={"x-request-id": "e2e-access-1"})
    client.chat.completions.create(model="routed", messages=ASK, max_tokens=2)
    httpx.get(worker.url + "/no/such/route", headers={"x-request-id": "e2e-access-404"})
    line = "POST /v1/chat/completions 200 "
    for srv in (router, worker):  # one id in both logs: the router forwards it
        wait_for(lambda srv=srv: any(line in ln and ln.endswith("id=e2e-access-1")
                                     for ln in srv.log_path.read_text().splitlines()),
                 "access line", srv.log_path, timeout=20)
    wait_for(lambda: "GET /no/such/route 404 " in worker.log_path.read_text(), "404 line",
             worker.log_path, timeout=20)
    hits = [ln for ln in router.log_path.read_text().splitlines() if "id=e2e-access-1" in ln]
    assert len(hits) == 1 and " INFO hearth.access: " in hits[0]


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_cut_off_by_max_tokens_is_length_with_what_was_recovered(worker, stream):
    client = worker.client()
    kw = dict(model="smol", messages=ASK, tools=[READ_FILE], tool_choice=NAMED, temperature=0)
    whole = client.chat.completions.create(max_tokens=60, **kw).choices[0]
    assert whole.finish_reason == "tool_calls"
    whole_args = whole.message.tool_calls[0].function.arguments
    if stream:
        content, calls, reason = assemble_stream(client.chat.completions.create(
            max_tokens=20, stream=True, **kw))
        calls = list(calls.values())
    else:
        choice = client.chat.completions.create(max_tokens=20, **kw).choices[0]
        content, reason = choice.message.content, choice.finish_reason
        calls = [{"name": c.function.name, "arguments": c.function.arguments}
                 for c in choice.message.tool_calls or []]
    assert reason == "length"
    assert not content  # no markup leaks into content
    assert [c["name"] for c in calls] == ["read_file"]
    cut = calls[0]["arguments"]  # what was produced: a proper prefix of the whole call's
    assert cut and whole_args.startswith(cut) and cut != whole_args


def test_a_call_cut_off_before_its_name_reports_nothing(worker):
    choice = worker.client().chat.completions.create(
        model="smol", messages=ASK, tools=[READ_FILE], tool_choice="required", max_tokens=4,
        temperature=0).choices[0]
    assert choice.finish_reason == "length"
    assert not choice.message.content and not choice.message.tool_calls


def test_jump_forward_parity_with_a_worker_that_decodes_forced_tokens(worker, tmp_path):
    slow = start_server(tmp_path, "--served-model-name", "smol", "--no-jump-forward", *SMALL)
    try:
        kw = dict(model="smol", messages=ASK, tools=[READ_FILE], tool_choice=NAMED,
                  temperature=0, max_tokens=60)
        forced_before = worker.load()["num_forced_tokens"]
        fast_reply = worker.client().chat.completions.create(**kw)
        slow_reply = slow.client().chat.completions.create(**kw)
        fast, ref = fast_reply.choices[0], slow_reply.choices[0]
        assert fast.finish_reason == ref.finish_reason == "tool_calls"
        assert [(c.function.name, c.function.arguments) for c in fast.message.tool_calls] == \
            [(c.function.name, c.function.arguments) for c in ref.message.tool_calls]
        assert fast_reply.usage.completion_tokens == slow_reply.usage.completion_tokens
        assert worker.load()["num_forced_tokens"] - forced_before >= 15
        assert slow.load()["num_forced_tokens"] == 0
        assert worker.wait_idle_and_whole()["kv_pool_is_whole"]
    finally:
        slow.stop()


def _children(pid: int) -> list[int]:
    path = f"/proc/{pid}/task/{pid}/children"
    return [int(p) for p in open(path).read().split()] if os.path.exists(path) else []


def _wait_gone(pids: list[int], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    for pid in pids:
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.02)
        else:
            pytest.fail(f"process {pid} still running {timeout:.0f} s after its server exited")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_normal_shutdown_is_quiet(tmp_path, sig):
    srv = start_server(tmp_path, *SMALL)
    srv.client().chat.completions.create(model="smollm2-135m-instruct", messages=ASK, max_tokens=2)
    children = _children(srv.process.pid)  # the engine core: it writes to the same log
    targets = [srv.process.pid] + (children if sig == signal.SIGINT else [])
    for pid in targets:  # Ctrl-C reaches the whole process group; SIGTERM only the server
        os.kill(pid, sig)
    assert srv.process.wait(timeout=30) in (0, -sig)  # uvicorn re-raises SIGTERM once done
    _wait_gone(children)  # every writer of the log has exited before it is read
    log = srv.log_path.read_text()
    assert " ERROR " not in log and "Traceback" not in log, log[-3000:]
    assert "IncompleteReadError" not in log or " INFO hearth.server.engine: " in log


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_router_shutdown_is_quiet(worker, tmp_path, sig):
    srv = start_router(tmp_path, "--worker", worker.url, "--worker-api-key", KEY)
    srv.client().chat.completions.create(model="smol", messages=ASK, max_tokens=2)
    os.kill(srv.process.pid, sig)
    assert srv.process.wait(timeout=30) in (0, -sig)
    log = srv.log_path.read_text()
    assert " ERROR " not in log and "Traceback" not in log, log[-3000:]
    assert " INFO uvicorn.error: " in log  # uvicorn's own lines in hearth's format

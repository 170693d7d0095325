"""Prefill/decode disaggregation end to end: real worker processes, real routers, the openai SDK.

Processes (started once for the module; each worker loads the default model, ~1 GB):
    P0, P1  hearth serve --role prefill     (P1 with a short lease, for the stall test)
    D0, D1  hearth serve --role decode
    the session's monolithic `server` (conftest.py) is the reference for greedy outputs
    routers hearth route (no model), started per purpose: they take ~2 s
No test depends on another having run (they pass in any order: `pytest --reverse`): a test that
kills or freezes workers does so to workers it starts itself, or thaws them before it ends.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.conftest import MODEL, REPO, Server, free_port, start_servers, stop_all, wait_for
from tests.e2e.test_tools import TOOLS, assemble_stream

SECRET = "pd-test-secret"
WORKER_FLAGS = ("--num-kv-blocks", "256", "--max-num-seqs", "8", "--kv-secret", SECRET)
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
GREEDY = dict(model=MODEL, temperature=0)
QUESTIONS = ["Name a fruit.", "Name a vegetable.", "Name a color.", "Name an animal."]


def start_router(tmp: Path, *flags: str) -> Server:
    port = free_port()
    log_path = tmp / f"router-{port}.log"
    cmd = [sys.executable, "-m", "hearth.cli", "route", "--port", str(port), "--model", MODEL,
           "--health-interval", "0.5", "--show-worker-urls", *flags]
    process = subprocess.Popen(cmd, cwd=REPO, stdout=open(log_path, "w"), stderr=subprocess.STDOUT,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    router = Server(process, f"http://127.0.0.1:{port}", None, log_path)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"router exited:\n{log_path.read_text()[-3000:]}")
        try:
            view = httpx.get(router.url + "/load", timeout=2).json()
            if all(e["healthy"] for e in view["endpoints"]):
                return router
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.3)
    router.stop()
    raise RuntimeError(f"router endpoints not healthy:\n{log_path.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pd")
    workers = dict(zip(("P0", "P1", "D0", "D1"), start_servers(
        tmp, ("--role", "prefill", "--kv-lease-seconds", "20", *WORKER_FLAGS),
        ("--role", "prefill", "--kv-lease-seconds", "3", *WORKER_FLAGS),
        ("--role", "decode", *WORKER_FLAGS), ("--role", "decode", *WORKER_FLAGS))))
    try:
        yield tmp, workers
    finally:
        stop_all(*workers.values())


@pytest.fixture(scope="module")
def router(stack):
    """P0 + D0 + D1 behind the default (cost) policy."""
    tmp, w = stack
    r = start_router(tmp, "--prefill", w["P0"].url, "--decode", w["D0"].url, w["D1"].url)
    yield r
    r.stop()


@pytest.fixture(scope="module")
def reference(client) -> openai.OpenAI:
    return client  # the session's monolithic worker


def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants (a worker is an HTTP process plus its engine process)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        todo += children.get(current, [])
    return tree


def signal_worker(worker: Server, signum: int) -> None:
    for pid in process_tree(worker.process.pid):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def kill_worker(worker: Server) -> None:
    signal_worker(worker, signal.SIGKILL)
    worker.process.wait()


def router_view(router: Server) -> dict[str, dict]:
    return {e["url"]: e for e in httpx.get(router.url + "/load", timeout=10).json()["endpoints"]}


def routed(router: Server) -> dict[str, int]:
    return {url: e["routed"] for url, e in router_view(router).items()}


def served_by(router: Server, before: dict[str, int]) -> set[str]:
    return {url for url, n in routed(router).items() if n > before.get(url, 0)}


def assert_whole(*workers: Server) -> None:
    for w in workers:
        report = w.wait_idle_and_whole()
        assert report["kv_pool_is_whole"] is True, (w.url, report)


# ---- correctness: PD output is the monolithic output ----------------------------------------


def test_pd_chat_equals_monolithic_streamed_and_not(router, reference, stack):
    client = router.client()
    kwargs = dict(GREEDY, messages=QUESTION, max_tokens=24)
    expected = reference.chat.completions.create(**kwargs)
    got = client.chat.completions.create(**kwargs)
    assert got.choices[0].message.content == expected.choices[0].message.content
    assert got.choices[0].finish_reason == expected.choices[0].finish_reason
    assert got.usage.prompt_tokens == expected.usage.prompt_tokens
    assert got.usage.completion_tokens == expected.usage.completion_tokens

    chunks = list(client.chat.completions.create(**kwargs, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected.choices[0].message.content
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.role) == 1
    assert chunks[-1].usage.completion_tokens == expected.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == expected.usage.prompt_tokens
    assert_whole(*(stack[1][k] for k in ("P0", "D0", "D1")))


@pytest.mark.parametrize("tool_choice,max_tokens", [("auto", 24), ("required", 80)])
def test_pd_tool_calls_equal_monolithic_streamed_and_not(router, reference, tool_choice, max_tokens):
    """`required`: the first token opens the call (`<`): the prefill hop must hold it back."""
    kwargs = dict(GREEDY, messages=[{"role": "user", "content": "What will the weather be in Paris "
                                     "for the next 3 days?"}], tools=TOOLS, tool_choice=tool_choice,
                  max_tokens=max_tokens)
    expected = reference.chat.completions.create(**kwargs).choices[0]
    got = router.client().chat.completions.create(**kwargs).choices[0]
    assert got.finish_reason == expected.finish_reason
    assert (got.message.content or "") == (expected.message.content or "")
    summary = lambda calls: [(c.function.name, c.function.arguments) for c in calls or []]  # noqa: E731
    assert summary(got.message.tool_calls) == summary(expected.message.tool_calls)
    content, calls, reason = assemble_stream(router.client().chat.completions.create(**kwargs, stream=True))
    assert reason == expected.finish_reason and content == (expected.message.content or "")
    assert [(c["name"], c["arguments"]) for c in calls.values()] == summary(expected.message.tool_calls)


def test_pd_completions_equal_monolithic(router, reference):
    kwargs = dict(GREEDY, prompt="The three primary colors are", max_tokens=16)
    expected = reference.completions.create(**kwargs).choices[0].text
    assert router.client().completions.create(**kwargs).choices[0].text == expected
    streamed = "".join(c.choices[0].text for c in router.client().completions.create(**kwargs, stream=True)
                       if c.choices)
    assert streamed == expected


def test_decode_worker_computes_no_prompt_token_it_received(router, stack):
    w = stack[1]
    before = {k: w[k].load() for k in ("D0", "D1")}
    messages = [{"role": "system", "content": "You are terse. " * 20}, *QUESTION]
    response = router.client().chat.completions.create(**GREEDY, messages=messages, max_tokens=8)
    after = {k: w[k].load() for k in ("D0", "D1")}
    used = [k for k in after if after[k]["num_transferred_tokens"] > before[k]["num_transferred_tokens"]]
    assert len(used) == 1, (before, after)
    k = used[0]
    assert after[k]["num_computed_prompt_tokens"] == before[k]["num_computed_prompt_tokens"]
    assert after[k]["num_transferred_tokens"] - before[k]["num_transferred_tokens"] == \
        response.usage.prompt_tokens
    assert after[k]["num_kv_transfer_failures"] == before[k]["num_kv_transfer_failures"]


# ---- usage and cache-aware routing -------------------------------------------------------------


def run_session(client: openai.OpenAI, system: str, turns: int, headers: dict | None = None,
                before_turn=None) -> list:
    history = [{"role": "system", "content": system}]
    responses = []
    for i, q in enumerate(QUESTIONS[:turns]):
        if before_turn:
            before_turn(i)
        history.append({"role": "user", "content": q})
        r = client.chat.completions.create(**GREEDY, messages=history, max_tokens=8,
                                           extra_headers=headers or {})
        responses.append(r)
        history.append({"role": "assistant", "content": r.choices[0].message.content})
    return responses


def test_cached_tokens_come_from_the_prefill_side_across_turns(stack, reference):
    """Always disaggregated (threshold 1.0): cached_tokens are the prefill worker's hits."""
    tmp, w = stack
    r = start_router(tmp, "--prefill", w["P0"].url, "--decode", w["D0"].url, "--disagg-threshold", "1.0")
    try:
        system = "You answer with one word. Session 7f3a. " + "Be brief. " * 30
        pd = run_session(r.client(), system, 3)
        mono = run_session(reference, system, 3)
        assert [x.choices[0].message.content for x in pd] == [x.choices[0].message.content for x in mono]
        assert pd[0].usage.prompt_tokens_details.cached_tokens == 0  # a new prefix
        tokenize = lambda msgs: httpx.post(r.url + "/tokenize", json={"messages": msgs},  # noqa: E731
                                           timeout=30).json()["tokens"]
        history = [{"role": "system", "content": system}]
        prompts = []
        for i, q in enumerate(QUESTIONS[:3]):
            history.append({"role": "user", "content": q})
            prompts.append(tokenize(history))
            history.append({"role": "assistant", "content": pd[i].choices[0].message.content})
        for i in (1, 2):
            # The prefill worker holds the earlier prompts' full blocks (not the outputs).
            shared = max(common_prefix(prompts[i], prompts[j]) for j in range(i))
            expected = min(shared // 16 * 16, len(prompts[i]) - 1)
            assert pd[i].usage.prompt_tokens == len(prompts[i])
            assert pd[i].usage.prompt_tokens_details.cached_tokens == expected
            assert expected > 0
    finally:
        r.stop()


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_later_turns_go_to_the_decode_worker_holding_the_kv(router, stack):
    """Two sessions start on different decode workers (the second while the first streams);
    each later turn, with or without the session header, goes back to its own worker."""
    w = stack[1]
    client = router.client()
    before = routed(router)
    long_stream = client.chat.completions.create(
        **GREEDY, messages=[{"role": "system", "content": "Session A. " * 60}, *QUESTION],
        max_tokens=60, extra_body={"ignore_eos": True}, stream=True)
    next(iter(long_stream))
    home_a = served_by(router, before) & {w["D0"].url, w["D1"].url}
    before = routed(router)
    client.chat.completions.create(**GREEDY, messages=[{"role": "system", "content": "Session B. " * 60},
                                                       *QUESTION], max_tokens=4)
    home_b = served_by(router, before) & {w["D0"].url, w["D1"].url}
    for _ in long_stream:
        pass
    assert len(home_a) == 1 and len(home_b) == 1 and home_a != home_b

    for system, home, headers in (("Session A. " * 60, home_a, {}),
                                  ("Session B. " * 60, home_b, {"x-session-affinity": "b"})):
        seen = []
        run_session(client, system, 3, headers,
                    before_turn=lambda i: seen.append(routed(router)))
        seen.append(routed(router))
        for i in range(1, 3):
            decode = {u for u, n in seen[i + 1].items() if n > seen[i][u]} & {w["D0"].url, w["D1"].url}
            assert decode == home, (system[:10], i, decode, home)


def test_next_turn_skips_the_prefill_hop_when_decode_holds_the_prompt(router):
    metrics = lambda: httpx.get(router.url + "/metrics", timeout=10).text  # noqa: E731
    count = lambda text, key: sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()  # noqa: E731
                                  if line.startswith(key))
    run_session(router.client(), "Session C, conditional disaggregation. " * 40, 1)
    before = metrics()
    run_session(router.client(), "Session C, conditional disaggregation. " * 40, 1)
    after = metrics()
    key = 'hearth:router_decisions_total{reason="cached"}'
    assert count(after, key) == count(before, key) + 1


# ---- failures ------------------------------------------------------------------------------


def test_transfer_stalled_past_its_lease_recomputes_and_frees_everything(stack, reference):
    """The prefill worker freezes after handing out a descriptor; the lease (3 s) expires; the
    decode worker then recomputes the prompt, the client gets the right answer, pools are whole."""
    _, w = stack
    p, d = w["P1"], w["D1"]
    body = dict(GREEDY, messages=QUESTION)
    prefill = httpx.post(p.url + "/v1/chat/completions", json={
        **body, "max_tokens": 1, "kv_transfer": {"role": "prefill", "transfer_id": "stall-1"}},
        timeout=60).json()
    before = d.load()
    expires_at = prefill["kv_transfer"]["descriptor"]["expires_at"]  # unix time, this host's clock
    signal_worker(p, signal.SIGSTOP)
    try:
        # The lease is a clock: what is waited for is its end (plus a second of margin).
        wait_for(lambda: time.time() > expires_at + 1.0, "the lease's end", p.log_path, timeout=60)
        result = {}

        def decode():
            kv = prefill["kv_transfer"]
            result["body"] = httpx.post(d.url + "/v1/chat/completions", json={
                **body, "max_tokens": 24, "kv_transfer": {
                    "role": "decode", "prompt_token_ids": kv["prompt_token_ids"],
                    "first_token_id": kv["first_token_id"], "descriptor": kv["descriptor"]}},
                timeout=120).json()
        thread = threading.Thread(target=decode)
        thread.start()
        # thawed only once the decode worker holds the request (its pull meets a frozen peer)
        wait_for(lambda: not thread.is_alive() or d.load()["num_requests_inflight"] > 0,
                 "the decode hop in flight",
                 d.log_path, timeout=60)
    finally:
        signal_worker(p, signal.SIGCONT)
    thread.join(timeout=120)
    assert not thread.is_alive()
    expected = reference.chat.completions.create(**body, max_tokens=24).choices[0].message.content
    first = prefill["choices"][0]["message"]["content"]
    assert first + result["body"]["choices"][0]["message"]["content"] in (expected, first + expected)
    after = d.load()
    assert after["num_kv_transfer_failures"] == before["num_kv_transfer_failures"] + 1
    assert_whole(p, d)
    assert p.load()["num_leases_active"] == 0


def test_killed_prefill_worker_is_retried_on_the_other(stack, reference):
    tmp, w = stack
    [victim] = start_servers(tmp, ("--role", "prefill", *WORKER_FLAGS))  # this test's own
    kwargs = dict(GREEDY, messages=[{"role": "user", "content": "Name three rivers."}], max_tokens=16)
    # The victim holds the prompt's blocks (P1 may hold its chat-template prefix from other
    # tests): the cost policy picks the victim first, whatever ran before.
    warm = httpx.post(victim.url + "/v1/chat/completions", json={
        **kwargs, "max_tokens": 1, "kv_transfer": {"role": "prefill", "transfer_id": "warm-1"}},
        timeout=60)
    assert warm.status_code == 200, warm.text
    # No active checks after the first: the router can only learn of the death from the hop.
    r = start_router(tmp, "--prefill", victim.url, w["P1"].url, "--decode", w["D0"].url,
                     "--health-interval", "3600")
    try:
        kill_worker(victim)
        got = r.client().chat.completions.create(**kwargs)
        assert got.choices[0].message.content == reference.chat.completions.create(**kwargs).choices[0].message.content
        view = router_view(r)
        assert view[victim.url]["failures"] == 1 and not view[victim.url]["healthy"]
        assert view[w["P1"].url]["routed"] == 1
    finally:
        stop_all(r, victim)
    assert_whole(w["P1"], w["D0"])


def kill_decode_mid_stream(router: Server, w: dict, **kwargs) -> tuple[str, list]:
    """Start a stream, kill the decode worker serving it after a few chunks; return (text, chunks)."""
    stream = router.client().chat.completions.create(**kwargs, stream=True)
    chunks = []
    killed = None
    for chunk in stream:
        chunks.append(chunk)
        if killed is None and len(chunks) == 5:
            busy = [url for url, e in router_view(router).items() if e["own_requests"] > 0
                    and e["role"] == "decode"]
            victim = next(x for x in w.values() if x.url in busy)
            kill_worker(victim)
            killed = victim
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


def test_killed_decode_workers_mid_stream(stack, reference):
    """Two decode workers of this test's own, killed one after the other while they stream:
    the first death is continued on the other worker in the same stream; after the second, a
    sampled stream ends with an error event and the router answers 503."""
    tmp, w = stack
    decoders = dict(zip(("Dx", "Dy"), start_servers(tmp, ("--role", "decode", *WORKER_FLAGS),
                                                    ("--role", "decode", *WORKER_FLAGS))))
    router = start_router(tmp, "--prefill", w["P0"].url, "--decode",
                          *(d.url for d in decoders.values()))
    try:
        kwargs = dict(GREEDY, messages=[{"role": "user", "content": "Count from one to thirty in words."}],
                      max_tokens=60, extra_body={"ignore_eos": True})
        expected = reference.chat.completions.create(**kwargs).choices[0].message.content
        text, chunks = kill_decode_mid_stream(router, decoders, **kwargs)
        assert text == expected  # continued on the other decode worker, nothing repeated or lost
        assert len({c.id for c in chunks}) == 1 and chunks[-1].choices[0].finish_reason == "length"
        metrics = httpx.get(router.url + "/metrics", timeout=10).text
        assert "hearth:router_continuations_total 1.0" in metrics

        kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me a long story."}],
                      max_tokens=60, temperature=1.0, extra_body={"ignore_eos": True})
        with pytest.raises(openai.APIError) as error:
            kill_decode_mid_stream(router, decoders, **kwargs)
        assert "decode" in str(error.value)
        # The router stays up and says why it cannot serve.
        with pytest.raises(openai.APIStatusError) as unavailable:
            router.client().chat.completions.create(**GREEDY, messages=QUESTION, max_tokens=4)
        assert unavailable.value.status_code == 503
        assert all(d.process.poll() is not None for d in decoders.values())
    finally:
        stop_all(router, *decoders.values())
    assert_whole(w["P0"])

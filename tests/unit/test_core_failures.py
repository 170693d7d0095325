"""Fail fast: a fault at any stage of the engine-core loop ends every open request with an error
at once, and the loop ends with the process's exit code; the server's EngineClient fails what the
core could not answer the moment the socket closes, and reports itself dead (`/health` 503).

The real loop (`serve_engine`) runs in a thread with a scripted stand-in engine; the thread then
closes its socket, as the process's exit would. The server side is the real EngineClient over the
other end of the socketpair. (A real core process failing: tests/e2e/test_spawn_core.py.)
"""

from __future__ import annotations

import asyncio
import errno
import socket
import subprocess
import threading
import time
from types import SimpleNamespace

import pytest

from hearth.config import EngineConfig
from hearth.engine.core_messages import BlockingChannel, ToCore
from hearth.engine import core_process
from hearth.engine.core_process import serve_engine
from hearth.engine.request import RequestOutput
from hearth.engine.sampling_params import SamplingParams
from hearth.server.engine_client import CoreProcess, EngineClient, EngineDeadError
from tests.unit.test_core_process import ScriptedEngine

PROMPT_WAIT_S = 10  # every waiter must be answered well within this: no timeout is ever reached
GRAMMAR_ID = "g"  # a request whose AddResult the core defers (its grammar "compiles" forever)


class FaultyEngine(ScriptedEngine):
    """Requests that never finish (one token a step); `fault` names the method that raises
    once the test arms it."""

    model_name, max_model_len, block_size, load_seconds = "scripted", 64, 16, 0.0

    class arch:
        vocab_size = 32

    def __init__(self) -> None:
        super().__init__(length=10**9)
        self.fault: str | None = None
        self.armed = False
        self.failed_steps = 0
        self.parked: set[str] = set()  # requests waiting for their grammar: not stepped

    def add_request(self, request_id, prompt_token_ids, params):
        if request_id == GRAMMAR_ID:
            self.parked.add(request_id)
        else:
            super().add_request(request_id, prompt_token_ids, params)

    def _maybe_fail(self, stage: str) -> None:
        if self.armed and self.fault == stage:
            raise RuntimeError(f"injected fault in {stage}")

    def is_waiting_for_grammar(self, request_id):
        self._maybe_fail("is_waiting_for_grammar")
        return request_id == GRAMMAR_ID

    @property
    def admissions(self):
        self._maybe_fail("admissions")
        return []

    @admissions.setter
    def admissions(self, value):  # ScriptedEngine's constructor sets it
        assert value == []

    def abort_request(self, request_id):
        self._maybe_fail("abort_request")
        if request_id in self.parked:
            self.parked.discard(request_id)
            self.aborted.append(request_id)
        super().abort_request(request_id)

    def has_unfinished(self):
        self._maybe_fail("has_unfinished")
        return super().has_unfinished() or bool(self.parked)

    def fatal_error(self):
        if self.armed and self.fault == "rank_lost":
            return "rank 1 (tp 1) died (exit code -9)"
        self._maybe_fail("fatal_error")
        return None

    def step(self):
        time.sleep(0.002)  # a step takes time: no busy spin beside the test
        if self.armed and self.fault == "step_and_recovery":
            self.failed_steps += 1
            raise RuntimeError(f"injected fault in step {self.failed_steps}")
        outputs = super().step()
        if self.armed and self.fault == "encode":  # a field msgspec cannot encode
            outputs.append(RequestOutput("r1", [object()], "x", False, None))  # type: ignore[list-item]
        return outputs

    def stats(self, expert_load=True):
        if self.armed and self.fault == "stats":  # the stand-in that lacked an argument
            raise TypeError("stats() got an unexpected keyword argument 'expert_load'")
        return super().stats(expert_load)

    def kv_pool_is_whole(self):
        self._maybe_fail("kv_pool_is_whole")
        return super().kv_pool_is_whole() and not self.parked

    def block_events_since(self, cursor):
        return cursor, [], []

    def tier_block_events_since(self, cursor):
        self._maybe_fail("tier_block_events_since")
        return {}


class CoreThread:
    """The core loop of a process, in a thread; Popen's poll/wait/kill for the EngineClient."""

    def __init__(self, engine: FaultyEngine) -> None:
        core_sock, self.server_sock = socket.socketpair()
        self.core_sock = core_sock
        self.channel = BlockingChannel(core_sock, ToCore)
        self.returncode: int | None = None
        self._engine = engine
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self.returncode = serve_engine(self._engine, self.channel)
        finally:
            self.core_sock.close()  # the process exits: the kernel closes its end

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise subprocess.TimeoutExpired("core thread", timeout or 0)
        return self.returncode

    def kill(self) -> None:
        self.core_sock.shutdown(socket.SHUT_RDWR)


def failing_select(*args):
    raise OSError(errno.EBADF, "injected fault in select")


def inject_send_failure(core: CoreThread) -> None:
    """The socket fails part-way through a step's outputs (not a closed peer)."""
    sock = core.core_sock

    class FailingSocket:
        def sendall(self, data):
            sock.sendall(data[: len(data) // 2])
            raise OSError(errno.ENOBUFS, "No buffer space available")

        def __getattr__(self, name):
            return getattr(sock, name)

    core.channel._sock = FailingSocket()


# stage -> (engine method that raises, how the test sets the stage off, exit code, the error
# the clients read)
STAGES = {
    "decode a message": (None, "garbage", 4, "ValidationError"),
    "add: grammar check": ("is_waiting_for_grammar", "add", 4, "injected fault"),
    "abort": ("abort_request", "abort", 4, "injected fault"),
    "load query: pool check": ("kv_pool_is_whole", "load", 4, "injected fault"),
    "load query: KV tier events": ("tier_block_events_since", "load", 4, "injected fault"),
    "wait for messages: select": (None, "select", 4, "injected fault"),
    "work check": ("has_unfinished", None, 4, "injected fault"),
    "rank set check: a bug": ("fatal_error", None, 4, "injected fault"),
    "rank set check: a lost rank": ("rank_lost", None, 3, "RankFailedError: rank 1"),
    "step, and its recovery step too": ("step_and_recovery", None, 4, "injected fault in step 2"),
    "answer deferred requests": ("admissions", None, 4, "injected fault"),
    "build outputs: stats": ("stats", None, 4, "unexpected keyword argument 'expert_load'"),
    "encode outputs": ("encode", None, 4, "TypeError: Encoding objects of type object"),
    "send outputs": (None, "send", 4, "engine process exited"),  # no last words: EOF
}


async def parked(engine: FaultyEngine) -> None:
    """Until the core has added the grammar request (it answers nothing for it yet)."""
    while GRAMMAR_ID not in engine.parked:
        await asyncio.sleep(0.001)


async def next_final(queue: asyncio.Queue) -> RequestOutput:
    while True:
        output = await asyncio.wait_for(queue.get(), PROMPT_WAIT_S)
        if output.finished:
            return output


@pytest.mark.parametrize("stage", list(STAGES))
async def test_a_fault_at_any_stage_ends_every_open_request_and_the_core(stage, monkeypatch):
    fault, trigger, exit_code, error = STAGES[stage]
    engine = FaultyEngine()
    engine.fault = fault
    core = CoreThread(engine)
    deaths = []
    client = EngineClient(EngineConfig(), on_dead=deaths.append,
                          core=CoreProcess(core, core.server_sock))  # type: ignore[arg-type]
    await client.start()
    try:
        await asyncio.wait_for(client.wait_ready(), PROMPT_WAIT_S)
        params = SamplingParams(max_tokens=10**6)
        queues = {rid: await client.add(rid, [1, 2], params) for rid in ("r1", "r2")}
        queues[GRAMMAR_ID] = asyncio.Queue()
        waiters = [client.add_nowait(GRAMMAR_ID, [1], params, queues[GRAMMAR_ID])]
        await asyncio.wait_for(queues["r1"].get(), PROMPT_WAIT_S)  # stepping
        await asyncio.wait_for(parked(engine), PROMPT_WAIT_S)
        assert not waiters[0].done()

        engine.armed = True
        load = None
        if trigger == "garbage":
            client._write(b"\x00\x00\x00\x04\x93\x01\x02\x03")  # a frame, not a message
        elif trigger == "add":
            queues["r3"] = asyncio.Queue()
            waiters.append(client.add_nowait("r3", [1], params, queues["r3"]))
        elif trigger == "abort":
            client.abort(["r2"])
        elif trigger == "load":
            load = asyncio.ensure_future(client.load(check_pool=True, events_since=0))
        elif trigger == "send":
            inject_send_failure(core)
        elif trigger == "select":
            monkeypatch.setattr(core_process, "select", SimpleNamespace(select=failing_select))

        finals = {rid: await next_final(queue) for rid, queue in queues.items()}
        assert {o.finish_reason for o in finals.values()} == {"error"}, finals
        assert all(error in o.error for o in finals.values()), {r: o.error for r, o in finals.items()}
        # every add waiter is answered (accepted, then the error output; or EngineDeadError)
        await asyncio.wait_for(asyncio.gather(*waiters, return_exceptions=True), PROMPT_WAIT_S)
        if load is not None:
            with pytest.raises(EngineDeadError):
                await asyncio.wait_for(load, PROMPT_WAIT_S)
        await asyncio.wait_for(client._read_task, PROMPT_WAIT_S)  # the socket closed
        assert await asyncio.to_thread(core.wait, PROMPT_WAIT_S) == exit_code
        assert client.failure and deaths == [client.failure] and not client.is_ready
        assert client.num_requests == 0 and not client._queries
        with pytest.raises(EngineDeadError):
            await client.add("late", [1], params)
        engine.armed = False
        if fault not in ("abort_request", "rank_lost"):  # the engine could abort them
            assert engine.kv_pool_is_whole()
    finally:
        await client.close(timeout=PROMPT_WAIT_S)


async def test_one_failed_step_fails_its_requests_and_the_core_goes_on():
    """The contrast: a step that fails once (its recovery step runs) is not fatal."""
    engine = FaultyEngine()
    core = CoreThread(engine)
    client = EngineClient(EngineConfig(), core=CoreProcess(core, core.server_sock))  # type: ignore[arg-type]
    await client.start()
    try:
        await asyncio.wait_for(client.wait_ready(), PROMPT_WAIT_S)
        queue = await client.add("r1", [1, 2], SamplingParams(max_tokens=10**6))
        await asyncio.wait_for(queue.get(), PROMPT_WAIT_S)
        engine.explode_once = True
        final = await next_final(queue)
        assert final.finish_reason == "error" and "kernel fault" in final.error
        load = await asyncio.wait_for(client.load(check_pool=True), PROMPT_WAIT_S)
        assert load.kv_pool_is_whole and client.is_ready and core.poll() is None
    finally:
        await client.close(timeout=PROMPT_WAIT_S)
    assert core.returncode == 0

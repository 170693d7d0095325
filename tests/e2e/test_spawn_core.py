"""The engine core spawned before the HTTP server exists (`spawn_core`, what `hearth serve` does
to overlap the two processes' start): it gets its config at once, the server's EngineClient
adopts it, and a core that no client adopted or started is ended, never left behind; a core
whose loop fails ends its requests with the error and exits."""

from __future__ import annotations

import asyncio
import time

import pytest

from hearth.engine.llm import make_engine_config
from hearth.engine.sampling_params import SamplingParams
from hearth.server.engine_client import EngineClient, EngineDeadError, spawn_core
from tests.e2e.conftest import MODEL


async def test_an_adopted_core_loads_and_serves_from_its_early_start() -> None:
    core = spawn_core(make_engine_config(MODEL), "WARNING")
    time.sleep(0.5)  # the server's own imports: the core is already at work meanwhile
    client = EngineClient(make_engine_config(MODEL), core=core)
    await client.start()
    try:
        info = await client.wait_ready()
        assert info.model_name == MODEL and client.is_ready
        load = await client.load(check_pool=True)
        assert load.kv_pool_is_whole
    finally:
        await client.close()
    assert core.process.poll() == 0


async def test_an_early_core_that_fails_to_load_reports_it_through_the_client() -> None:
    config = make_engine_config("/no/such/model.gguf")
    client = EngineClient(config, core=spawn_core(config, "ERROR"))
    await client.start()
    with pytest.raises(EngineDeadError, match="no/such/model.gguf"):
        await client.wait_ready()
    await client.close()
    assert client._process.poll() is not None


async def test_a_core_never_adopted_is_ended_by_close() -> None:
    core = spawn_core(make_engine_config(MODEL), "ERROR")
    client = EngineClient(make_engine_config(MODEL), core=core)  # the server failed before start()
    await client.close()
    assert core.process.poll() is not None and core.sock.fileno() == -1


def test_kill_ends_a_loading_core() -> None:
    core = spawn_core(make_engine_config(MODEL), "ERROR")
    core.kill()
    assert core.process.returncode is not None and core.sock.fileno() == -1


async def test_a_core_whose_loop_fails_ends_its_requests_with_the_error_and_exits_4() -> None:
    """A fault in the real core's loop (a frame that is no message, which the core fails to
    decode) ends the request in flight with that error at once; the process exits with code 4
    and the client is dead (its /health would answer 503). Every stage: test_core_failures.py."""
    config = make_engine_config(MODEL)
    deaths = []
    client = EngineClient(config, on_dead=deaths.append, core=spawn_core(config, "ERROR"))
    await client.start()
    try:
        await client.wait_ready()
        queue = await client.add("long", [1, 2, 3], SamplingParams(max_tokens=4000, ignore_eos=True))
        assert not (await asyncio.wait_for(queue.get(), 60)).finished
        client._write(b"\x00\x00\x00\x04\x93\x01\x02\x03")  # msgpack, not a message
        while not (output := await asyncio.wait_for(queue.get(), 10)).finished:
            pass
        assert output.finish_reason == "error" and "ValidationError" in output.error
        assert await asyncio.to_thread(client._process.wait, 30) == 4
        await asyncio.wait_for(client._read_task, 10)
        assert client.failure and deaths == [client.failure] and client.num_requests == 0
    finally:
        await client.close()

"""The engine core spawned before the HTTP server exists (`spawn_core`, what `hearth serve` does
to overlap the two processes' start): it gets its config at once, the server's EngineClient
adopts it, and a core that no client adopted or started is ended, never left behind."""

from __future__ import annotations

import time

import pytest

from hearth.engine.llm import make_engine_config
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

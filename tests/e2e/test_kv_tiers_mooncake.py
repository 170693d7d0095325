"""The Mooncake Store tier against a real `mooncake_master` on loopback (skipped without it).

Two stores (two "workers") share blocks through the master: one writes them through as they are
computed, the other loads them. With the master killed, lookups miss at once, loads recompute
and writes are dropped on the writer thread: the engine side never errors and never hangs.
(Here, not in tests/unit: a real master process, and a store whose master died takes ~10 s in
the Mooncake client's teardown.)
"""

import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch

from hearth.config import KVOffloadConfig
from hearth.kv_tiers.mooncake_store import mooncake_available
from tests.unit.test_kv_tiers import BS, Rig, block_value, tokens

pytestmark = pytest.mark.skipif(not mooncake_available(), reason="mooncake not installed")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def master(tmp_path):
    import mooncake
    binary = Path(mooncake.__file__).parent / "mooncake_master"
    if not binary.exists():
        pytest.skip("the mooncake package has no mooncake_master binary")
    rpc, http, metrics = free_port(), free_port(), free_port()
    log = open(tmp_path / "master.log", "w")
    proc = subprocess.Popen([str(binary), f"-rpc_port={rpc}", "-enable_http_metadata_server=true",
                             f"-http_metadata_server_port={http}", f"-metrics_port={metrics}"],
                            stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", rpc), timeout=0.5).close()
            break
        except OSError:
            time.sleep(0.1)
    config = KVOffloadConfig(mooncake_master=f"127.0.0.1:{rpc}",
                             mooncake_metadata=f"http://127.0.0.1:{http}/metadata",
                             mooncake_segment_gb=0.0625)
    yield config, proc
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


def test_two_workers_share_blocks_through_mooncake_store(master):
    config, _ = master
    a, b = Rig(config), Rig(config)
    assert a.store.tier_names == ("mooncake",) and a.driver.kv.pool.cache_listener is not None
    prompt = tokens(3 * BS + 1)
    first = a.run_prompt("a", prompt)
    a.flush()  # written through: a still holds the blocks in its pool
    req = b.run_prompt("b", prompt)
    assert req.num_cached_tokens == 3 * BS
    assert b.driver.stats()["mooncake"]["hits"] == 3
    for i, h in enumerate(first.block_hashes[:3]):
        assert torch.equal(b.kv_cache[:, :, b.last_block_ids[i]], block_value(h))
    assert a.pool.is_whole() and b.pool.is_whole()
    a.close()
    b.close()


def test_a_dead_master_degrades_to_recompute(master):
    config, proc = master
    a, b = Rig(config), Rig(config)
    prompt = tokens(3 * BS + 1)
    a.run_prompt("a", prompt)
    a.flush()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    # b never saw the blocks: its lookups ask the dead master. Run beside a watchdog: a lookup
    # that hangs on the dead master (the bug this guards) would block for minutes.
    done: list = []
    runner = threading.Thread(target=lambda: done.append(b.run_prompt("b", prompt)), daemon=True)
    runner.start()
    runner.join(timeout=60)
    assert done, "the prompt hung on the dead master"
    [req] = done
    assert req.num_cached_tokens == 0 and b.pool.is_whole()
    # b's 3 computed blocks go to the dead master: the first put that waits out the client's
    # timeout (~4-8 s) marks the master down and the rest are dropped at once, so the writer's
    # queue drains within flush()'s 10 s (one timeout per block took ~24 s)
    b.flush()
    tier = b.store.tiers[0]
    assert tier.counters["write_errors"] == 3 and tier.counters["stored"] == 0
    a.close()  # each close waits ~15 s in the Mooncake client on the dead master
    b.close()

"""The Mooncake transport: one-sided reads of leased blocks, and PD parity over it.

Mooncake's listeners bind every interface and cannot be told otherwise, so these tests run only
inside a private network namespace: `test_in_private_netns` re-runs this file under
`unshare --net` (root) with loopback up, where the inner tests execute.
"""

import os
import shutil
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from hearth.kv_transfer.mooncake_transport import mooncake_available, private_netns_command

IN_NETNS = os.environ.get("HEARTH_PRIVATE_NETNS") == "1"
needs_mooncake = pytest.mark.skipif(
    not mooncake_available(),
    reason="mooncake not installed (pip install mooncake-transfer-engine-non-cuda; "
           "apt-get install libibverbs1 libnl-3-200 libnl-route-3-200)")
inside = pytest.mark.skipif(not IN_NETNS, reason="runs inside test_in_private_netns")


@needs_mooncake
@pytest.mark.skipif(IN_NETNS, reason="already inside the namespace")
def test_in_private_netns():
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("ip"):
        pytest.skip("needs root, unshare and ip to make a private network namespace")
    cmd = private_netns_command([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                 __file__])
    proc = subprocess.run(cmd, env=dict(os.environ, HEARTH_PRIVATE_NETNS="1"),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "2 passed, 1 skipped" in proc.stdout.splitlines()[-1]  # this test skips inside


@needs_mooncake
@inside
def test_guarded_one_sided_read_lands_exact_blocks():
    from hearth.kv_transfer.kv_memory import KVMemory
    from hearth.kv_transfer.leases import LeaseManager
    from hearth.kv_transfer.mooncake_transport import MooncakeTransport
    from hearth.kv_transfer.tcp_transport import TransferClient, TransferServer

    shape = (3, 2, 10, 4, 2, 8)
    src, dst = torch.randn(shape), torch.zeros(shape)
    src_mem, dst_mem = KVMemory(src), KVMemory(dst)
    leases = LeaseManager(30)
    server = TransferServer("127.0.0.1", 0, "s", leases, src_mem)
    src_engine, dst_engine = MooncakeTransport("127.0.0.1", src_mem), MooncakeTransport(
        "127.0.0.1", dst_mem)
    try:
        leases.create("t", [6, 7, 2])
        client = TransferClient("s")
        with client.connect("127.0.0.1", server.port, "t") as sock:
            client.open(sock, "t")
            n = dst_engine.read(src_engine.session, src_mem.base_address, src_mem.num_blocks,
                                [6, 7, 2], [0, 1, 5])
            leases.sweep()
            assert leases.num_active == 1 and leases.take_released() == []
            client.finish(sock, "t", ack=True)  # ends the guard and the lease
            assert leases.take_released() == [[6, 7, 2]]
        assert n == 3 * src_mem.bytes_per_block
        for local, remote in ((0, 6), (1, 7), (5, 2)):
            assert torch.equal(dst[:, :, local], src[:, :, remote])
        untouched = [b for b in range(shape[2]) if b not in (0, 1, 5)]
        assert not dst[:, :, untouched].any()
    finally:
        server.close()
        src_engine.close()
        dst_engine.close()


@needs_mooncake
@inside
def test_pd_greedy_over_mooncake(models):
    from hearth.config import KVTransferConfig
    from hearth.kv_transfer.connector import make_connector
    from tests.model.test_kv_transfer import CASES, decode_all, prefill_all

    base = models.config(num_blocks=64)
    engines = []
    for role in ("prefill", "decode"):
        config = replace(base, kv_transfer=KVTransferConfig(role=role, transport="mooncake",
                                                            secret="s"))
        engines.append(models.engine(config, connector_factory=make_connector))
    prefill, decode = engines
    try:
        prompts = {f"m{i}": c["prompt_ids"] for i, c in enumerate(CASES[:2])}
        firsts = prefill_all(prefill, prompts)
        assert firsts["m0"].kv_descriptor.mooncake_session
        results = decode_all(decode, prompts, firsts, 8)
        for (rid, ids), case in zip(prompts.items(), CASES):
            tokens, final = results[rid]
            assert tokens == case["output_ids"][:8]
            assert final.num_transferred_tokens == len(ids)
        assert decode.stats().num_computed_prompt_tokens == 0
        assert prefill.stats().num_leases_active == 0
        assert prefill.kv_pool_is_whole() and decode.kv_pool_is_whole()
    finally:
        prefill.close()
        decode.close()

"""KV transfer throughput over loopback, per transport: GB/s for 1-64 MB of blocks.

    .venv/bin/python benchmarks/kv_transfer.py [--transports tcp,tcp-staged,mooncake]

The KV geometry is the default model's (SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64,
16-token blocks, fp32: 720 KiB per block, each block 60 separate 12 KiB plane chunks). Blocks
are scattered (a random permutation on each side), as in a pool that has been running a while.
Each timing is one whole pull as the decode side does it: connect + authenticate + request +
receive + ACK; the best of --repeats runs is reported.

  tcp         hearth's transport: sendmsg/recvmsg_into straight from/into the KV tensors
  tcp-staged  the alternative it replaces: gather blocks into a contiguous buffer, sendall,
              recv_into a contiguous buffer, scatter into the blocks (one copy per side)
  mooncake    Mooncake Transfer Engine, TCP protocol, one batched one-sided read (lease guarded
              over the tcp control connection). Its listeners bind every interface, so this
              benchmark re-runs itself in a private network namespace (root, `unshare -n`).
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import threading
import time

import torch

from hearth.kv_transfer.kv_memory import KVMemory
from hearth.kv_transfer.leases import LeaseManager
from hearth.kv_transfer.mooncake_transport import (MooncakeTransport, mooncake_available,
                                              private_netns_command)
from hearth.kv_transfer.tcp_transport import TransferClient, TransferServer

SHAPE = dict(num_layers=30, block_size=16, num_kv_heads=3, head_dim=64)
SIZES_MB = (1, 4, 16, 64)


def make_kv(num_blocks: int, seed: int) -> torch.Tensor:
    s = SHAPE
    return torch.randn(s["num_layers"], 2, num_blocks, s["block_size"], s["num_kv_heads"],
                       s["head_dim"], generator=torch.Generator().manual_seed(seed))


def scattered(num: int, num_blocks: int, seed: int) -> list[int]:
    return torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))[:num].tolist()


class Bench:
    def __init__(self, num_blocks: int) -> None:
        self.src, self.dst = make_kv(num_blocks, 0), torch.zeros_like(make_kv(num_blocks, 0))
        self.src_mem, self.dst_mem = KVMemory(self.src), KVMemory(self.dst)
        self.leases = LeaseManager(3600)
        self.server = TransferServer("127.0.0.1", 0, "bench", self.leases, self.src_mem)
        self.client = TransferClient("bench")
        self.mooncake_src = self.mooncake_dst = None
        self._next = 0

    def tcp(self, src_ids: list[int], dst_ids: list[int]) -> float:
        tid = self._lease(src_ids)
        t0 = time.perf_counter()
        with self.client.connect("127.0.0.1", self.server.port, tid) as sock:
            self.client.pull(sock, tid, list(range(len(src_ids))), self.dst_mem.buffers(dst_ids),
                             self.dst_mem.bytes_per_block)
            self.client.finish(sock, tid)
        return time.perf_counter() - t0

    def mooncake(self, src_ids: list[int], dst_ids: list[int]) -> float:
        if self.mooncake_src is None:
            self.mooncake_src = MooncakeTransport("127.0.0.1", self.src_mem)
            self.mooncake_dst = MooncakeTransport("127.0.0.1", self.dst_mem)
            self.mooncake(src_ids[:1], dst_ids[:1])  # first contact opens the segment
        tid = self._lease(src_ids)
        t0 = time.perf_counter()
        with self.client.connect("127.0.0.1", self.server.port, tid) as sock:
            self.client.open(sock, tid)
            self.mooncake_dst.read(self.mooncake_src.session, self.src_mem.base_address,
                                   self.src_mem.num_blocks, src_ids, dst_ids)
            self.client.finish(sock, tid)
        return time.perf_counter() - t0

    def tcp_staged(self, src_ids: list[int], dst_ids: list[int]) -> float:
        a, b = socket.socketpair()  # the same kernel loopback path, no protocol around it
        size = len(src_ids) * self.src_mem.bytes_per_block
        src_index, dst_index = torch.tensor(src_ids), torch.tensor(dst_ids)

        def send():
            staging = self.src.index_select(2, src_index)  # gather: one copy
            a.sendall(memoryview(staging.view(-1).view(torch.uint8).numpy()))

        t0 = time.perf_counter()
        sender = threading.Thread(target=send)
        sender.start()
        staging = torch.empty((size,), dtype=torch.uint8)
        view, got = memoryview(staging.numpy()), 0
        while got < size:
            got += b.recv_into(view[got:])
        shaped = staging.view(self.dst.dtype).view(self.dst[:, :, :len(dst_ids)].shape)
        self.dst.index_copy_(2, dst_index, shaped)  # scatter: one copy
        sender.join()
        elapsed = time.perf_counter() - t0
        a.close()
        b.close()
        return elapsed

    def check(self, src_ids: list[int], dst_ids: list[int]) -> None:
        assert torch.equal(self.dst[:, :, dst_ids], self.src[:, :, src_ids]), "bytes differ"
        self.dst.zero_()

    def _lease(self, block_ids: list[int]) -> str:
        self._next += 1
        self.leases.create(f"b{self._next}", block_ids)
        self.leases.take_released()
        return f"b{self._next}"

    def close(self) -> None:
        self.server.close()
        for m in (self.mooncake_src, self.mooncake_dst):
            if m is not None:
                m.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--transports", default="tcp,tcp-staged,mooncake")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--ids", choices=["scattered", "contiguous"], default="scattered",
                   help="block ids on both sides: a random permutation, or one run")
    a = p.parse_args()
    transports = a.transports.split(",")
    if "mooncake" in transports:
        if not mooncake_available():
            print("mooncake: not installed (pip install mooncake-transfer-engine-non-cuda)")
            transports.remove("mooncake")
        elif os.environ.get("HEARTH_PRIVATE_NETNS") != "1":
            env = dict(os.environ, HEARTH_PRIVATE_NETNS="1")
            return subprocess.call(private_netns_command([sys.executable, *sys.argv]), env=env)
    bytes_per_block = 2 * SHAPE["num_layers"] * SHAPE["block_size"] * SHAPE["num_kv_heads"] \
        * SHAPE["head_dim"] * 4
    num_blocks = 2 * (64 * 2**20 // bytes_per_block + 1)
    bench = Bench(num_blocks)
    print(f"KV transfer over loopback, {bytes_per_block // 1024} KiB blocks, {a.ids} ids, "
          f"best of {a.repeats}")
    print(f"{'MB':>6} {'blocks':>6} " + " ".join(f"{t + ' GB/s':>16}" for t in transports))
    for mb in SIZES_MB:
        n = max(1, mb * 2**20 // bytes_per_block)
        if a.ids == "scattered":
            src_ids, dst_ids = scattered(n, num_blocks, 1), scattered(n, num_blocks, 2)
        else:
            src_ids, dst_ids = list(range(n)), list(range(n, 2 * n))
        cells = []
        for transport in transports:
            fn = getattr(bench, transport.replace("-", "_"))
            best = min(fn(src_ids, dst_ids) for _ in range(a.repeats))
            bench.check(src_ids, dst_ids)
            cells.append(f"{n * bytes_per_block / best / 1e9:16.2f}")
        print(f"{n * bytes_per_block / 2**20:6.1f} {n:6d} " + " ".join(cells))
    bench.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

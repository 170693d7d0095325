"""KV transport over the Mooncake Transfer Engine (one-sided reads), P2P-handshake mode.

Each worker runs one Mooncake engine with its whole KV tensor registered. The prefill side
advertises its engine's session ("host:rpc_port"), the tensor's base address and its number of
blocks in the descriptor; the decode side computes each plane's byte range from those and reads
them into its own registered tensor in one batch.

Mooncake moves bytes only: it knows nothing of leases, and its listeners bind every interface
with no way to restrict them (run it on a trusted network; tests use a private network
namespace). So the lease is guarded over hearth's TCP control connection: OPEN before the
reads, ACK after; a decode worker that dies mid-read drops that connection and the guard with it.

Install: `pip install mooncake-transfer-engine-non-cuda` (CPU machines; needs Debian's
libibverbs1 libnl-3-200 libnl-route-3-200) or `mooncake-transfer-engine` (CUDA).
"""

from __future__ import annotations

import logging

from hearth.kv_transfer.kv_memory import KVMemory, coalesce_pairs

log = logging.getLogger("hearth.kv_transfer.mooncake")

# Ranges per batch call: its TCP lanes reject a batch of a few thousand ranges (queue full),
# while 256 costs nothing measurable over one big batch (benchmarks/kv_transfer.py).
MAX_BATCH = 256


def mooncake_available() -> bool:
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except ImportError:
        return False
    return True


class MooncakeTransport:
    def __init__(self, host: str, memory: KVMemory) -> None:
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:
            raise ValueError("kv transport 'mooncake' needs the mooncake-transfer-engine "
                             f"package (pip install 'hearth[mooncake]'): {exc}") from None
        self.memory = memory
        self.engine = TransferEngine()
        if self.engine.initialize(host, "P2PHANDSHAKE", "tcp", "") != 0:
            raise RuntimeError(f"Mooncake transfer engine failed to start on {host}")
        if self.engine.register_memory(memory.base_address, memory.num_bytes) != 0:
            raise RuntimeError("Mooncake could not register the KV tensor")
        self.session = f"{host}:{self.engine.get_rpc_port()}"
        log.info("Mooncake transfer engine at %s, %d KV bytes registered", self.session,
                 memory.num_bytes)

    def read(self, session: str, remote_base: int, remote_num_blocks: int,
             remote_block_ids: list[int], local_block_ids: list[int]) -> int:
        """Copy remote blocks into local ones (same order); returns the bytes moved."""
        chunk = self.memory.chunk_bytes
        runs = coalesce_pairs(remote_block_ids, local_block_ids)
        local, remote, lengths = [], [], []
        for plane in range(self.memory.num_planes):
            for src, dst, count in runs:
                remote.append(remote_base + (plane * remote_num_blocks + src) * chunk)
                local.append(self.memory.address(plane, dst))
                lengths.append(count * chunk)
        for start in range(0, len(local), MAX_BATCH):
            end = start + MAX_BATCH
            rc = self.engine.batch_transfer_sync_read(session, local[start:end],
                                                      remote[start:end], lengths[start:end])
            if rc != 0:
                raise ConnectionError(f"Mooncake read from {session} failed (rc={rc})")
        return sum(lengths)

    def close(self) -> None:
        try:
            self.engine.unregister_memory(self.memory.base_address)
        except Exception:  # the engine may already be gone at interpreter exit
            log.debug("Mooncake unregister failed", exc_info=True)


def private_netns_command(argv: list[str]) -> list[str]:
    """`argv` wrapped to run in a fresh network namespace with only loopback up (root only).

    For tests and benchmarks: Mooncake's listeners bind every interface, so they run where no
    other machine can reach them."""
    return ["unshare", "--net", "sh", "-c", 'ip link set lo up && exec "$@"', "sh", *argv]

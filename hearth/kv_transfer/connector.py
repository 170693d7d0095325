"""DisaggConnector: the engine's KVConnector, built from a worker's KVTransferConfig.

Prefill side (role prefill|both): a lease manager and a TCP transfer server over this worker's
KV tensor; exporting a request creates a lease and a descriptor. Decode side (role decode|both):
a small pool of transfer threads; each import connects to the descriptor's server, pulls the
missing blocks straight into the local KV tensor (TCP) or reads them one-sided (Mooncake, when
both sides run it) and acknowledges. Results reach the engine only through `poll`.

Trust (decode side): a descriptor arrives in a decode hop's body, so its host:port is checked
against the peer allowlist (`hearth.kv_transfer.peers`, `--kv-peers`) before any socket is opened,
and the transfer server must prove the shared secret for this transfer before any request.

Failure handling (decode side): any error (peer gone or not trusted, lease unknown or expired,
layout mismatch, timeout) reports the import as failed after the thread stopped writing; the engine
then recomputes the missing prompt tokens locally. The prefill side's lease then ends on its own
(expiry), or at once when the peer could still answer and was sent a REJECT.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch

from hearth.config import KVTransferConfig, Role
from hearth.kv_transfer.descriptor import (DESCRIPTOR_VERSION, KVDescriptor, check_against,
                                      check_descriptor, check_transfer_id, tokens_hash)
from hearth.kv_transfer.kv_memory import KVMemory
from hearth.kv_transfer.leases import LeaseManager
from hearth.kv_transfer.peers import TrustedPeers, normalize_host
from hearth.kv_transfer.tcp_transport import TransferClient, TransferServer
from hearth.kv_transfer.wire import WireError
from hearth.engine.kv.transfer_api import ConnectorEvents, ImportResult, KVCacheGeometry, KVTransfer
from hearth.engine.refusals import RequestRejected

log = logging.getLogger("hearth.kv_transfer")

TRANSPORTS = ("tcp", "mooncake")


class DisaggConnector:
    def __init__(self, config: KVTransferConfig, kv_cache: torch.Tensor,
                 geometry: KVCacheGeometry, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time) -> None:
        if config.transport not in TRANSPORTS:
            raise ValueError(f"kv transport: {config.transport!r} is not one of {TRANSPORTS}")
        if config.host in ("0.0.0.0", "::", "") and not config.advertise_host:
            raise ValueError("kv host: a wildcard bind address needs --kv-advertise-host (the "
                             "address decode workers connect to)")
        self.config = config
        self.geometry = geometry
        self.wall_clock = wall_clock
        self.memory = KVMemory(kv_cache)
        self.leases = LeaseManager(config.lease_seconds, clock, max_blocks=max(
            1, int(config.max_leased_fraction * geometry.num_blocks)))
        self.peers = TrustedPeers(config.peers, config.peers_file)
        self.client = TransferClient(config.secret, config.io_timeout_seconds)
        self.mooncake = None
        if config.transport == "mooncake":
            from hearth.kv_transfer.mooncake_transport import MooncakeTransport
            self.mooncake = MooncakeTransport(config.advertise_host or config.host, self.memory)
        self.server = None
        if config.role in (Role.PREFILL, Role.BOTH):
            self.server = TransferServer(config.host, config.port, config.secret, self.leases,
                                         self.memory, config.io_timeout_seconds,
                                         handshake_timeout=config.handshake_timeout_seconds)
        self._pool = None
        if config.role in (Role.DECODE, Role.BOTH):
            self._pool = ThreadPoolExecutor(config.num_transfer_threads,
                                            thread_name_prefix="hearth-kv-import")
        self._lock = threading.Lock()
        self._done: list[ImportResult] = []
        self._done_event = threading.Event()

    # ---- prefill side ---------------------------------------------------------------------
    def check_export(self, transfer_id: str) -> None:
        if self.server is None:
            raise RequestRejected(
                "kv_transfer",
                f"kv_transfer: a {self.config.role} worker does not export KV")
        check_transfer_id(transfer_id)
        if self.leases.contains(transfer_id):
            raise RequestRejected(
                "kv_transfer.transfer_id",
                f"kv_transfer.transfer_id: {transfer_id!r} is already leased")

    def export(self, transfer_id: str, block_ids: list[int], block_hashes: list[int],
               prompt_token_ids: list[int]) -> KVDescriptor:
        self.leases.create(transfer_id, block_ids)
        g, c = self.geometry, self.config
        return KVDescriptor(
            version=DESCRIPTOR_VERSION, transfer_id=transfer_id, transport=c.transport,
            host=c.advertise_host or self.server.host, port=self.server.port,
            num_tokens=len(prompt_token_ids), block_size=g.block_size, block_ids=list(block_ids),
            block_hashes=list(block_hashes),
            tokens_hash=tokens_hash(prompt_token_ids, block_hashes, g.block_size),
            num_layers=g.num_layers, num_kv_heads=g.num_kv_heads, head_dim=g.head_dim,
            dtype=g.dtype, bytes_per_block=g.bytes_per_block, num_planes=g.num_planes,
            expires_at=self.wall_clock() + c.lease_seconds,
            mooncake_session=self.mooncake.session if self.mooncake else "",
            mooncake_base_address=self.memory.base_address if self.mooncake else 0,
            mooncake_num_blocks=self.memory.num_blocks if self.mooncake else 0,
        )

    # ---- decode side ----------------------------------------------------------------------
    def check_import(self, transfer: KVTransfer, prompt_token_ids: list[int]) -> KVDescriptor:
        if self._pool is None:
            raise RequestRejected(
                "kv_transfer",
                f"kv_transfer: a {self.config.role} worker does not import KV")
        if transfer.descriptor is None:
            raise RequestRejected(
                "kv_transfer.descriptor",
                "kv_transfer.descriptor: required on a decode hop")
        check_descriptor(transfer.descriptor)
        check_against(transfer.descriptor, self.geometry, prompt_token_ids)
        return transfer.descriptor

    def start_import(self, request_id: str, handle: KVDescriptor, positions: list[int],
                     block_ids: list[int]) -> None:
        future = self._pool.submit(self._import, request_id, handle, positions, block_ids)
        future.add_done_callback(lambda f: f.cancelled() and self._report(
            ImportResult(request_id, False, error="the KV connector was closed")))

    def reject(self, handle: KVDescriptor) -> None:
        """Tell the prefill side, in the background, that its blocks will not be read."""
        if self._pool is not None:
            self._pool.submit(self._reject, handle)

    def _import(self, request_id: str, d: KVDescriptor, positions: list[int],
                block_ids: list[int]) -> None:
        try:
            num_bytes = self._transfer(d, positions, block_ids)
            result = ImportResult(request_id, True, len(positions), num_bytes)
        except Exception as exc:
            # A partial write may have left any bytes in the blocks, also in slots past the
            # prompt that recompute never overwrites and attention still reads (masked, but
            # inf/NaN survive masking): leave them zeroed, as fresh as a new pool's.
            if block_ids:
                self.memory.tensor.index_fill_(2, torch.tensor(block_ids), 0)
            result = ImportResult(request_id, False, error=f"{type(exc).__name__}: {exc}")
        self._report(result)

    def _report(self, result: ImportResult) -> None:
        with self._lock:
            self._done.append(result)
            self._done_event.set()

    def _transfer(self, d: KVDescriptor, positions: list[int], block_ids: list[int]) -> int:
        """Move the blocks and acknowledge; returns the bytes received. Raises on failure, after
        the last write to the blocks."""
        with self._connect(d) as sock:
            num_bytes = 0
            try:
                if positions and self.mooncake is not None and d.mooncake_session:
                    self.client.open(sock, d.transfer_id)  # the lease's read guard
                    num_bytes = self.mooncake.read(
                        d.mooncake_session, d.mooncake_base_address, d.mooncake_num_blocks,
                        [d.block_ids[p] for p in positions], block_ids)
                elif positions:
                    num_bytes = self.client.pull(sock, d.transfer_id, positions,
                                                 self.memory.buffers(block_ids),
                                                 self.memory.bytes_per_block)
            except WireError:  # the peer answered: tell it to drop the lease now
                _quietly(self.client.finish, sock, d.transfer_id, False)
                raise
            try:
                self.client.finish(sock, d.transfer_id, ack=True)
            except (OSError, WireError) as exc:  # data is complete; the lease will expire
                log.warning("ack of transfer %s failed: %s", d.transfer_id, exc)
            return num_bytes

    def _reject(self, d: KVDescriptor) -> None:
        try:
            with self._connect(d) as sock:
                self.client.finish(sock, d.transfer_id, ack=False)
        except (OSError, WireError, UntrustedPeer) as exc:
            log.info("reject of transfer %s not delivered: %s", d.transfer_id, exc)

    def _connect(self, d: KVDescriptor) -> socket.socket:
        """An authenticated connection for `d`'s transfer, to an allowed peer only: a descriptor
        comes from whoever posted the decode hop, so no socket is opened to anywhere else."""
        if not self.peers.allows(d.host, d.port):
            log.warning("KV descriptor names %s:%s, which is not a trusted KV peer (%s; set "
                        "--kv-peers); recomputing instead", d.host, d.port, self.peers.describe())
            raise UntrustedPeer(f"{d.host}:{d.port} is not in the KV peer allowlist")
        if d.mooncake_session and self.mooncake is not None:
            session_host = d.mooncake_session.rpartition(":")[0]
            if normalize_host(session_host) != normalize_host(d.host):
                raise UntrustedPeer(f"mooncake session {d.mooncake_session!r} is not on the "
                                    f"descriptor's host {d.host}")
        return self.client.connect(d.host, d.port, d.transfer_id)

    # ---- engine loop ----------------------------------------------------------------------
    def poll(self) -> ConnectorEvents:
        self.leases.sweep()
        with self._lock:
            imports, self._done = self._done, []
            self._done_event.clear()
        return ConnectorEvents(self.leases.take_released(), imports)

    def wait(self, timeout: float) -> None:
        self._done_event.wait(timeout)

    def num_leases(self) -> int:
        return self.leases.num_active

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        if self.mooncake is not None:
            self.mooncake.close()
        self.leases.close()


class UntrustedPeer(Exception):
    """A descriptor named a KV server this worker is not configured to trust."""


def make_connector(config: KVTransferConfig, kv_cache: torch.Tensor,
                   geometry: KVCacheGeometry) -> DisaggConnector:
    """The `ConnectorFactory` the server gives `LLMEngine` for roles prefill and decode."""
    return DisaggConnector(config, kv_cache, geometry)


def _quietly(fn, *args) -> None:
    try:
        fn(*args)
    except (OSError, WireError):
        pass

"""hearth's own KV transport: blocking sockets, scatter/gather I/O, leases checked per read.

Server (prefill worker): one thread accepts, one thread serves each connection. A connection
starts with the mutual handshake (client HELLO -> server HELLO -> client AUTH -> server OK, see
`wire`), which binds it to one transfer id, then carries any number of PULL / OPEN / ACK /
REJECT requests for that transfer. A protocol error is answered with ERROR and ends that
connection only; the server thread and every other connection carry on. Blocks are read only
under a lease's read guard, held for the length of a PULL, or from OPEN until
ACK/REJECT/disconnect on that connection (one-sided transports read in between).

Slots: a connection takes one of `max_connections` only once it has authenticated. Before
that it must finish the handshake within `handshake_timeout`, and unauthenticated connections
are capped per peer IP and in total, the oldest dropped first; so idle or slow sockets cannot
keep a real decode worker out.

Client (decode worker): `TransferClient.connect` + `pull`/`open`/`finish`, called from the
connector's transfer threads. Every socket has a timeout, so a dead peer fails a transfer
instead of hanging it.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import time
from collections import OrderedDict

from hearth.kv_transfer.kv_memory import KVMemory
from hearth.kv_transfer.leases import LeaseManager
from hearth.kv_transfer.wire import (CLIENT, MAX_PULL_BLOCKS, NONCE_BYTES, SERVER, Header, MsgType,
                                Status, WireError, expect, proof, proof_ok, recv_buffers,
                                recv_exact, recv_header, send_buffers, send_error, send_header)

log = logging.getLogger("hearth.kv_transfer.tcp")


class TransferServer:
    def __init__(self, host: str, port: int, secret: str, leases: LeaseManager,
                 memory: KVMemory, io_timeout: float = 30.0, max_connections: int = 64,
                 handshake_timeout: float = 2.0, max_unauthenticated: int = 128,
                 max_unauthenticated_per_peer: int = 8) -> None:
        self.secret = secret
        self.leases = leases
        self.memory = memory
        self.io_timeout = io_timeout
        self.max_connections = max_connections
        self.handshake_timeout = handshake_timeout
        self.max_unauthenticated = max_unauthenticated
        self.max_unauthenticated_per_peer = max_unauthenticated_per_peer
        self._listener = socket.create_server((host, port), backlog=128)
        self.host, self.port = self._listener.getsockname()[:2]
        # Connections still in their handshake, oldest first (socket -> peer IP), and the ones
        # past it. Only the latter count against max_connections.
        self._pending: OrderedDict[socket.socket, str] = OrderedDict()
        self._connections: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, daemon=True,
                                        name=f"hearth-kv-server-{self.port}")
        self._thread.start()

    def close(self) -> None:
        """Stop accepting, drop every connection (their read guards end), join the acceptor."""
        self._closed = True
        for sock in [self._listener, *self._snapshot()]:
            _shutdown(sock)
        self._listener.close()
        self._thread.join(timeout=5)

    def _snapshot(self) -> list[socket.socket]:
        with self._lock:
            return [*self._pending, *self._connections]

    def num_connections(self) -> tuple[int, int]:
        """(authenticated, still in the handshake)."""
        with self._lock:
            return len(self._connections), len(self._pending)

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, address = self._listener.accept()
            except OSError:
                if self._closed:
                    return
                continue
            with self._lock:
                evicted = self._admit(conn, address[0])
            for old in evicted:  # its thread sees the shutdown and ends
                _shutdown(old)
            threading.Thread(target=self._serve, args=(conn,), daemon=True,
                             name="hearth-kv-conn").start()

    def _admit(self, conn: socket.socket, peer_ip: str) -> list[socket.socket]:
        """Under the lock: register a new unauthenticated connection; past the per-peer or total
        limit the *oldest* unauthenticated ones make room (they had the longest to speak), so
        idle sockets cannot keep a real peer from connecting."""
        self._pending[conn] = peer_ip
        evicted = []
        same_peer = [c for c, ip in self._pending.items() if ip == peer_ip]
        for old in same_peer[:max(0, len(same_peer) - self.max_unauthenticated_per_peer)]:
            evicted.append(old)
            del self._pending[old]
        while len(self._pending) > self.max_unauthenticated:
            evicted.append(self._pending.popitem(last=False)[0])
        if evicted:
            log.warning("KV transfer server: dropped %d connections that had not authenticated "
                        "(newest from %s)", len(evicted), peer_ip)
        return evicted

    def _serve(self, conn: socket.socket) -> None:
        guards: set[str] = set()  # leases this connection holds open (OPEN .. ACK/REJECT)
        try:
            conn.settimeout(self.handshake_timeout)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            transfer_id = self._handshake(conn)
            if transfer_id is not None and self._promote(conn):
                conn.settimeout(self.io_timeout)
                while not self._closed and self._handle(conn, recv_header(conn), guards,
                                                        transfer_id):
                    pass
        except WireError as exc:
            log.warning("KV transfer peer broke the protocol: %s", exc)
            _close_with_error(conn, exc.status, str(exc))
        except (OSError, ConnectionError) as exc:  # peer gone, timed out or evicted
            log.debug("KV transfer connection ended: %s", exc)
        except Exception:
            log.exception("KV transfer connection failed")
        finally:
            for tid in guards:
                self.leases.end_read(tid)
            with self._lock:
                self._pending.pop(conn, None)
                self._connections.discard(conn)
            conn.close()

    def _handshake(self, conn: socket.socket) -> str | None:
        """The server's half of the mutual handshake (`wire.proof`), all of it within
        `handshake_timeout`; the transfer id the connection is bound to, or None."""
        deadline = time.monotonic() + self.handshake_timeout
        hello = recv_header(conn, deadline)
        if hello.msg_type != MsgType.HELLO or hello.payload_bytes or not hello.transfer_id:
            raise WireError(Status.BAD_REQUEST, "the handshake starts with HELLO(transfer id)")
        tid, client_nonce, server_nonce = hello.transfer_id, hello.auth, os.urandom(NONCE_BYTES)
        send_header(conn, Header(MsgType.HELLO, transfer_id=tid, auth=server_nonce))
        auth = recv_header(conn, deadline)
        if auth.msg_type != MsgType.AUTH or not proof_ok(self.secret, CLIENT, client_nonce,
                                                         server_nonce, tid, auth.auth):
            log.warning("KV transfer peer %s failed authentication", _peer(conn))
            _close_with_error(conn, Status.BAD_AUTH, "authentication failed")
            return None
        send_header(conn, Header(MsgType.OK, transfer_id=tid,
                                 auth=proof(self.secret, SERVER, client_nonce, server_nonce, tid)))
        return tid

    def _promote(self, conn: socket.socket) -> bool:
        """An authenticated connection takes a slot, or is told BUSY."""
        with self._lock:
            if self._pending.pop(conn, None) is None:  # evicted meanwhile
                return False
            busy = len(self._connections) >= self.max_connections
            if not busy:
                self._connections.add(conn)
        if busy:
            _close_with_error(conn, Status.BUSY, "too many transfer connections")
        return not busy

    def _handle(self, conn: socket.socket, header: Header, guards: set[str],
                bound_id: str) -> bool:
        """Serve one request; False ends the connection."""
        kind, tid = header.msg_type, header.transfer_id
        if tid != bound_id:
            raise WireError(Status.BAD_REQUEST, f"this connection authenticated for transfer "
                                                f"{bound_id!r}, not {tid!r}")
        if kind == MsgType.PULL:
            self._pull(conn, header)
        elif kind == MsgType.OPEN and header.payload_bytes == 0:
            if tid in guards or self.leases.begin_read(tid) is not None:
                guards.add(tid)
                send_header(conn, Header(MsgType.OK, transfer_id=tid))
            else:
                send_error(conn, Status.UNKNOWN_TRANSFER, f"no live lease {tid!r}", tid)
        elif kind in (MsgType.ACK, MsgType.REJECT) and header.payload_bytes == 0:
            if tid in guards:
                guards.discard(tid)
                self.leases.end_read(tid)
            reason = "ack" if kind == MsgType.ACK else "reject"
            if self.leases.release(tid, reason):
                send_header(conn, Header(MsgType.OK, transfer_id=tid))
            else:
                send_error(conn, Status.UNKNOWN_TRANSFER, f"no live lease {tid!r}", tid)
        else:
            raise WireError(Status.BAD_REQUEST, f"unexpected {kind.name} "
                                                f"({header.payload_bytes} payload bytes)")
        return True

    def _pull(self, conn: socket.socket, header: Header) -> None:
        n, tid = header.num_blocks, header.transfer_id
        if not 0 < n <= MAX_PULL_BLOCKS or header.payload_bytes != 4 * n:
            raise WireError(Status.BAD_REQUEST, f"PULL of {n} blocks with "
                                                f"{header.payload_bytes} payload bytes")
        positions = struct.unpack(f"!{n}I", recv_exact(conn, 4 * n))
        if header.bytes_per_block != self.memory.bytes_per_block:
            send_error(conn, Status.LAYOUT_MISMATCH, f"{header.bytes_per_block} bytes per block "
                       f"asked, this worker has {self.memory.bytes_per_block}", tid)
            return
        block_ids = self.leases.begin_read(tid)
        if block_ids is None:
            send_error(conn, Status.UNKNOWN_TRANSFER, f"no live lease {tid!r}", tid)
            return
        try:  # the read guard keeps the blocks ours until the last byte is out
            if max(positions) >= len(block_ids):
                send_error(conn, Status.LAYOUT_MISMATCH, f"position {max(positions)} is past "
                           f"the lease's {len(block_ids)} blocks", tid)
                return
            size = n * self.memory.bytes_per_block
            send_header(conn, Header(MsgType.DATA, num_blocks=n,
                                     bytes_per_block=self.memory.bytes_per_block,
                                     payload_bytes=size, transfer_id=tid))
            send_buffers(conn, self.memory.buffers([block_ids[p] for p in positions]))
        finally:
            self.leases.end_read(tid)


class TransferClient:
    def __init__(self, secret: str, io_timeout: float = 30.0) -> None:
        self.secret = secret
        self.io_timeout = io_timeout

    def connect(self, host: str, port: int, transfer_id: str) -> socket.socket:
        """A connection authenticated both ways for `transfer_id` (`wire.proof`): nothing is
        requested from a server that has not proven it holds the secret."""
        sock = socket.create_connection((host, port), timeout=self.io_timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            client_nonce = os.urandom(NONCE_BYTES)
            send_header(sock, Header(MsgType.HELLO, transfer_id=transfer_id, auth=client_nonce))
            hello = expect(sock, MsgType.HELLO)
            if hello.transfer_id != transfer_id:
                raise WireError(Status.BAD_AUTH, "the KV peer answered for another transfer")
            server_nonce = hello.auth
            send_header(sock, Header(MsgType.AUTH, transfer_id=transfer_id, auth=proof(
                self.secret, CLIENT, client_nonce, server_nonce, transfer_id)))
            ok = expect(sock, MsgType.OK)
            if not proof_ok(self.secret, SERVER, client_nonce, server_nonce, transfer_id, ok.auth):
                raise WireError(Status.BAD_AUTH, f"the KV peer {host}:{port} did not prove the "
                                                 f"shared secret")
        except BaseException:
            sock.close()
            raise
        return sock

    def pull(self, sock: socket.socket, transfer_id: str, positions: list[int],
             buffers: list[memoryview], bytes_per_block: int) -> int:
        """Receive the blocks at `positions` of the lease straight into `buffers` (wire order)."""
        n = len(positions)
        payload = struct.pack(f"!{n}I", *positions)
        send_header(sock, Header(MsgType.PULL, num_blocks=n, bytes_per_block=bytes_per_block,
                                 payload_bytes=len(payload), transfer_id=transfer_id), payload)
        header = expect(sock, MsgType.DATA)
        size = n * bytes_per_block
        if header.num_blocks != n or header.payload_bytes != size:
            raise WireError(Status.BAD_REQUEST, f"DATA of {header.num_blocks} blocks / "
                                                f"{header.payload_bytes} bytes, asked {n} / {size}")
        recv_buffers_checked(sock, buffers, size)
        return size

    def open(self, sock: socket.socket, transfer_id: str) -> None:
        send_header(sock, Header(MsgType.OPEN, transfer_id=transfer_id))
        expect(sock, MsgType.OK)

    def finish(self, sock: socket.socket, transfer_id: str, ack: bool = True) -> None:
        """ACK (blocks received) or REJECT (not wanted): either way the lease ends."""
        send_header(sock, Header(MsgType.ACK if ack else MsgType.REJECT, transfer_id=transfer_id))
        expect(sock, MsgType.OK)


def recv_buffers_checked(sock: socket.socket, buffers: list[memoryview], size: int) -> None:
    if sum(len(b) for b in buffers) != size:
        raise ValueError(f"destination holds {sum(len(b) for b in buffers)} bytes, "
                         f"{size} expected")
    recv_buffers(sock, buffers)


def _close_with_error(conn: socket.socket, status: Status, message: str) -> None:
    try:
        send_error(conn, status, message)
    except OSError:
        pass
    try:
        conn.close()
    except OSError:
        pass


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _peer(conn: socket.socket) -> str:
    try:
        return "%s:%s" % conn.getpeername()[:2]
    except OSError:
        return "?"

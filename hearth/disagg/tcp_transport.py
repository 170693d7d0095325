"""hearth's own KV transport: blocking sockets, scatter/gather I/O, leases checked per read.

Server (prefill worker): one thread accepts, one thread serves each connection. A connection
starts with a challenge (HELLO nonce -> AUTH HMAC(secret, nonce) -> OK), then carries any number
of PULL / OPEN / ACK / REJECT requests (see `wire`). A protocol error is answered with ERROR and
ends that connection only; the server thread and every other connection carry on. Blocks are
read only under a lease's read guard, held for the length of a PULL, or from OPEN until
ACK/REJECT/disconnect on that connection (one-sided transports read in between).

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

from hearth.disagg.kv_memory import KVMemory
from hearth.disagg.leases import LeaseManager
from hearth.disagg.wire import (MAX_PULL_BLOCKS, Header, MsgType, Status, WireError, auth_ok,
                                auth_tag, expect, recv_buffers, recv_exact, recv_header,
                                send_buffers, send_error, send_header)

log = logging.getLogger("hearth.disagg.tcp")


class TransferServer:
    def __init__(self, host: str, port: int, secret: str, leases: LeaseManager,
                 memory: KVMemory, io_timeout: float = 30.0, max_connections: int = 64) -> None:
        self.secret = secret
        self.leases = leases
        self.memory = memory
        self.io_timeout = io_timeout
        self.max_connections = max_connections
        self._listener = socket.create_server((host, port), backlog=64)
        self.host, self.port = self._listener.getsockname()[:2]
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
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._listener.close()
        self._thread.join(timeout=5)

    def _snapshot(self) -> list[socket.socket]:
        with self._lock:
            return list(self._connections)

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                if self._closed:
                    return
                continue
            with self._lock:
                busy = len(self._connections) >= self.max_connections
                if not busy:
                    self._connections.add(conn)
            if busy:
                _close_with_error(conn, Status.BUSY, "too many transfer connections")
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True,
                             name="hearth-kv-conn").start()

    def _serve(self, conn: socket.socket) -> None:
        guards: set[str] = set()  # leases this connection holds open (OPEN .. ACK/REJECT)
        try:
            conn.settimeout(self.io_timeout)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._handshake(conn):
                while not self._closed and self._handle(conn, recv_header(conn), guards):
                    pass
        except WireError as exc:
            log.warning("KV transfer peer broke the protocol: %s", exc)
            _close_with_error(conn, exc.status, str(exc))
        except (OSError, ConnectionError) as exc:  # peer gone or timed out: nothing to answer
            log.debug("KV transfer connection ended: %s", exc)
        except Exception:
            log.exception("KV transfer connection failed")
        finally:
            for transfer_id in guards:
                self.leases.end_read(transfer_id)
            with self._lock:
                self._connections.discard(conn)
            conn.close()

    def _handshake(self, conn: socket.socket) -> bool:
        nonce = os.urandom(32)
        send_header(conn, Header(MsgType.HELLO, auth=nonce))
        header = recv_header(conn)
        if header.msg_type != MsgType.AUTH or not auth_ok(self.secret, nonce, header.auth):
            log.warning("KV transfer peer %s failed authentication", _peer(conn))
            _close_with_error(conn, Status.BAD_AUTH, "authentication failed")
            return False
        send_header(conn, Header(MsgType.OK))
        return True

    def _handle(self, conn: socket.socket, header: Header, guards: set[str]) -> bool:
        """Serve one request; False ends the connection."""
        kind, tid = header.msg_type, header.transfer_id
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

    def connect(self, host: str, port: int) -> socket.socket:
        sock = socket.create_connection((host, port), timeout=self.io_timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            hello = expect(sock, MsgType.HELLO)
            send_header(sock, Header(MsgType.AUTH, auth=auth_tag(self.secret, hello.auth)))
            expect(sock, MsgType.OK)
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


def _peer(conn: socket.socket) -> str:
    try:
        return "%s:%s" % conn.getpeername()[:2]
    except OSError:
        return "?"

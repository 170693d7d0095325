"""The KV transfer wire format: a fixed 128-byte header, then raw bytes. Nothing is pickled.

    offset size field            (network byte order)
         0    4 magic            b"HKVX"
         4    2 version          WIRE_VERSION; a peer refuses any other
         6    2 msg_type         MsgType
         8    2 status           Status (responses; 0 in requests)
        10    2 reserved         0
        12    4 num_blocks       PULL/DATA: blocks in the payload
        16    8 bytes_per_block  PULL: the reader's layout check; DATA: the sender's
        24    8 payload_bytes    bytes that follow the header
        32   64 transfer_id      UTF-8, NUL-padded
        96   32 auth             handshake only: a nonce (HELLO) or a proof (AUTH, OK)

The handshake is mutual and bound to one transfer (see `proof`): the client (decode side) sends
HELLO(transfer_id, its nonce), the server answers HELLO(transfer_id, its nonce), the client
proves the secret in AUTH, the server checks it and proves the secret in OK, and the client
checks that before it sends a request. The connection then serves that transfer id only.

Payloads: PULL carries num_blocks u32 block positions (indices into the descriptor's block list);
DATA carries the blocks as `[num_layers, planes, num_blocks, block_size, heads, dim]` (planes: K
and V, or MLA's one latent plane), i.e. for each (layer, plane) the requested blocks in request order; ERROR carries a UTF-8
message. Bytes go out with scatter/gather `sendmsg` from the KV tensor and come in with
`recvmsg_into` straight into the destination blocks: no staging copy on either side.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import socket
import struct
import time
from dataclasses import dataclass

MAGIC = b"HKVX"
WIRE_VERSION = 2  # 2: mutual handshake bound to the transfer id
HEADER = struct.Struct("!4sHHHHIQQ64s32s")
HEADER_BYTES = HEADER.size  # 128
MAX_PULL_BLOCKS = 1 << 20
MAX_ERROR_BYTES = 4096
IOV_MAX = 1024  # Linux limit on buffers per sendmsg/recvmsg call


class MsgType(enum.IntEnum):
    HELLO = 1  # both ways, client first: transfer id + a fresh nonce
    AUTH = 2  # client -> server: the client's proof
    PULL = 3  # client -> server: send me these block positions of a lease
    DATA = 4  # server -> client: the blocks
    OPEN = 5  # client -> server: guard a lease for one-sided reads (mooncake) on this connection
    ACK = 6  # client -> server: all blocks received, release the lease
    REJECT = 7  # client -> server: won't use the blocks, release the lease
    OK = 8  # server -> client (the one ending the handshake carries the server's proof)
    ERROR = 9  # server -> client: status + message


class Status(enum.IntEnum):
    OK = 0
    BAD_REQUEST = 1  # malformed header or payload
    BAD_AUTH = 2
    UNKNOWN_TRANSFER = 3  # no live lease: never existed, acknowledged, rejected or expired
    LAYOUT_MISMATCH = 4  # bytes_per_block or positions do not fit the lease
    BUSY = 5  # too many connections


class WireError(Exception):
    """The peer broke the protocol or answered with an error status."""

    def __init__(self, status: Status, message: str) -> None:
        super().__init__(f"{status.name}: {message}")
        self.status = status


@dataclass(frozen=True)
class Header:
    msg_type: MsgType
    status: Status = Status.OK
    num_blocks: int = 0
    bytes_per_block: int = 0
    payload_bytes: int = 0
    transfer_id: str = ""
    auth: bytes = b""

    def pack(self) -> bytes:
        return HEADER.pack(MAGIC, WIRE_VERSION, self.msg_type, self.status, 0, self.num_blocks,
                           self.bytes_per_block, self.payload_bytes,
                           self.transfer_id.encode(), self.auth)

    @classmethod
    def unpack(cls, raw: bytes) -> Header:
        (magic, version, msg_type, status, _, num_blocks, bpb, payload, tid,
         auth) = HEADER.unpack(raw)
        if magic != MAGIC:
            raise WireError(Status.BAD_REQUEST, f"bad magic {magic!r}")
        if version != WIRE_VERSION:
            raise WireError(Status.BAD_REQUEST, f"wire version {version}, expected {WIRE_VERSION}")
        try:
            kind, code = MsgType(msg_type), Status(status)
            transfer_id = tid.rstrip(b"\0").decode()
        except ValueError as exc:
            raise WireError(Status.BAD_REQUEST, f"bad header field: {exc}") from None
        return cls(kind, code, num_blocks, bpb, payload, transfer_id, auth)


NONCE_BYTES = 32
PROOF_LABEL = b"hearth-kv/2 "
CLIENT, SERVER = b"client", b"server"  # who proves: a proof of one side never passes as the other's


def proof(secret: str, side: bytes, client_nonce: bytes, server_nonce: bytes,
          transfer_id: str) -> bytes:
    """HMAC-SHA256(secret, label | side | client nonce | server nonce | transfer id).

    Both fresh nonces make a proof good for one connection only; the transfer id binds it to one
    lease; the side label stops a peer from reflecting the other side's proof back at it."""
    message = (PROOF_LABEL + side + b"\0" + client_nonce + server_nonce
               + transfer_id.encode())
    return hmac.new(secret.encode(), message, hashlib.sha256).digest()


def proof_ok(secret: str, side: bytes, client_nonce: bytes, server_nonce: bytes,
             transfer_id: str, tag: bytes) -> bool:
    return hmac.compare_digest(proof(secret, side, client_nonce, server_nonce, transfer_id), tag)


def send_header(sock: socket.socket, header: Header, payload: bytes = b"") -> None:
    sock.sendall(header.pack() + payload)


def send_error(sock: socket.socket, status: Status, message: str, transfer_id: str = "") -> None:
    body = message.encode()[:MAX_ERROR_BYTES]
    send_header(sock, Header(MsgType.ERROR, status, payload_bytes=len(body),
                             transfer_id=transfer_id), body)


def recv_exact(sock: socket.socket, num_bytes: int, deadline: float | None = None) -> bytes:
    buf = bytearray(num_bytes)
    recv_buffers(sock, [memoryview(buf)], deadline)
    return bytes(buf)


def recv_header(sock: socket.socket, deadline: float | None = None) -> Header:
    return Header.unpack(recv_exact(sock, HEADER_BYTES, deadline))


def expect(sock: socket.socket, msg_type: MsgType) -> Header:
    """Receive the next header; an ERROR from the peer (or another type) raises WireError."""
    header = recv_header(sock)
    if header.msg_type == MsgType.ERROR:
        size = min(header.payload_bytes, MAX_ERROR_BYTES)
        raise WireError(header.status, recv_exact(sock, size).decode(errors="replace"))
    if header.msg_type != msg_type:
        raise WireError(Status.BAD_REQUEST, f"expected {msg_type.name}, got {header.msg_type.name}")
    return header


def send_buffers(sock: socket.socket, buffers: list[memoryview]) -> None:
    """sendall over many buffers with scatter/gather I/O (partial sends resumed)."""
    pending, i = list(buffers), 0
    while i < len(pending):
        sent = sock.sendmsg(pending[i:i + IOV_MAX])
        i = _advance(pending, i, sent)


def recv_buffers(sock: socket.socket, buffers: list[memoryview],
                 deadline: float | None = None) -> None:
    """Fill every buffer from the socket, in order; EOF first raises ConnectionError. With a
    `deadline` (time.monotonic) the whole read must end by then (socket.timeout), however slowly
    the peer trickles bytes in."""
    pending, i = list(buffers), 0
    while i < len(pending):
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise socket.timeout("deadline passed")
            sock.settimeout(remaining)
        got = sock.recvmsg_into(pending[i:i + IOV_MAX])[0]
        if got == 0:
            raise ConnectionError("peer closed the connection mid-transfer")
        i = _advance(pending, i, got)


def _advance(pending: list[memoryview], i: int, num_bytes: int) -> int:
    """Consume `num_bytes` from pending[i:], trimming a partly done buffer in place."""
    while num_bytes:
        size = len(pending[i])
        if num_bytes >= size:
            num_bytes -= size
            i += 1
        else:
            pending[i] = pending[i][num_bytes:]
            num_bytes = 0
    while i < len(pending) and len(pending[i]) == 0:
        i += 1
    return i

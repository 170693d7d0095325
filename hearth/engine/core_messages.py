"""The typed messages between a server process and its engine-core process, and their framing.

One Struct per message, tagged with a `Kind` enum value; msgpack bodies in length-prefixed frames
over a private local socket (a socketpair inherited by the child). Nothing here is pickled:
a peer can only ever make the other side build these types.

    frame := u32 big-endian body length | msgpack(message)

Flow:
    server -> core   StartEngine, then any of AddRequest, AbortRequests, QueryLoad, Shutdown
    core -> server   EngineReady | EngineFailed, then AddResult (one per AddRequest),
                     StepOutputs (one per engine step that produced outputs), LoadReply

A core whose loop fails sends one last StepOutputs ending every open request with the error,
half-closes its socket and exits (hearth/engine/core_process.py); the server fails anything
else still open when the socket closes.
"""

from __future__ import annotations

import enum
import select
import socket
import struct
import time
from typing import Union

import msgspec

from hearth.config import EngineConfig
from hearth.engine.kv.transfer_api import KVTransfer
from hearth.engine.refusals import Rejection
from hearth.engine.request import RequestOutput
from hearth.engine.sampling_params import SamplingParams
from hearth.engine.stats import EngineStats

MAX_FRAME_BYTES = 256 * 2**20  # a prompt of a million token ids is ~5 MB; anything past this is a bug
_HEADER = struct.Struct(">I")


class Kind(enum.IntEnum):
    START_ENGINE = 1
    ADD_REQUEST = 2
    ABORT_REQUESTS = 3
    QUERY_LOAD = 4
    SHUTDOWN = 5
    ENGINE_READY = 16
    ENGINE_FAILED = 17
    ADD_RESULT = 18
    STEP_OUTPUTS = 19
    LOAD_REPLY = 20


# ---- server -> core --------------------------------------------------------------------------


class StartEngine(msgspec.Struct, tag=int(Kind.START_ENGINE)):
    config: EngineConfig


class AddRequest(msgspec.Struct, tag=int(Kind.ADD_REQUEST)):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    kv_transfer: KVTransfer | None = None  # prefill/decode hop of a disaggregated request
    # a resumed stream's output so far (generated elsewhere): LLMEngine.add_request
    output_token_ids: list[int] = []


class AbortRequests(msgspec.Struct, tag=int(Kind.ABORT_REQUESTS)):
    request_ids: list[str]


class QueryLoad(msgspec.Struct, tag=int(Kind.QUERY_LOAD)):
    query_id: int
    check_pool: bool = False  # also run the KV pool's integrity check (tests, debugging)
    events_since: int | None = None  # also report prefix-cache block events after this cursor


class Shutdown(msgspec.Struct, tag=int(Kind.SHUTDOWN)):
    pass


# ---- core -> server --------------------------------------------------------------------------


class EngineReady(msgspec.Struct, tag=int(Kind.ENGINE_READY)):
    model_name: str
    max_model_len: int
    vocab_size: int
    block_size: int
    load_seconds: float
    stats: EngineStats


class EngineFailed(msgspec.Struct, tag=int(Kind.ENGINE_FAILED)):
    message: str


class AddResult(msgspec.Struct, tag=int(Kind.ADD_RESULT)):
    request_id: str
    rejection: Rejection | None = None  # why the engine refused the request (None: accepted)


class StepOutputs(msgspec.Struct, tag=int(Kind.STEP_OUTPUTS)):
    outputs: list[RequestOutput]
    stats: EngineStats


class LoadReply(msgspec.Struct, tag=int(Kind.LOAD_REPLY)):
    query_id: int
    stats: EngineStats
    kv_pool_is_whole: bool | None = None  # None unless asked (check_pool)
    events_cursor: int = 0  # with events_since: the cursor to ask from next time
    stored_hashes: list[int] = []  # block hashes entered in the prefix cache since the cursor
    evicted_hashes: list[int] = []  # block hashes evicted since the cursor
    # the same for the KV tiers below the pool: tier name -> [stored hashes, evicted hashes]
    tier_hashes: dict[str, list[list[int]]] = {}


ToCore = Union[StartEngine, AddRequest, AbortRequests, QueryLoad, Shutdown]
FromCore = Union[EngineReady, EngineFailed, AddResult, StepOutputs, LoadReply]


class FrameCodec:
    """Encodes messages into frames and decodes frames of one direction's message union."""

    def __init__(self, incoming: type) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(incoming)

    def encode(self, message: msgspec.Struct) -> bytes:
        body = self._encoder.encode(message)
        return _HEADER.pack(len(body)) + body

    def decode_body(self, body: bytes):
        return self._decoder.decode(body)

    @staticmethod
    def body_length(header: bytes) -> int:
        (length,) = _HEADER.unpack(header)
        if length > MAX_FRAME_BYTES:
            raise ValueError(f"frame of {length} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")
        return length


HEADER_BYTES = _HEADER.size


class ChannelClosed(ConnectionError):
    """The peer closed the socket (or reset it): the other process has gone."""


class BlockingChannel:
    """Frames over a blocking socket (the core process side).

    A frame is encoded whole before any byte is sent, so an encode error leaves the channel
    usable; a send that fails part-way leaves it broken, and every later send raises at once
    (a half-written frame must never be followed by another)."""

    def __init__(self, sock: socket.socket, incoming: type) -> None:
        self._sock = sock
        self._codec = FrameCodec(incoming)
        self._broken = False

    def send(self, message: msgspec.Struct) -> None:
        frame = self._codec.encode(message)
        if self._broken:
            raise OSError("the engine socket broke during an earlier send")
        try:
            self._sock.sendall(frame)
        except ConnectionError as exc:
            self._broken = True
            raise ChannelClosed(f"peer closed the engine socket ({exc})") from exc
        except OSError:
            self._broken = True
            raise

    def finish(self, timeout: float) -> None:
        """Half-close (the peer reads EOF after the frames already sent), then discard what the
        peer still sends until it closes its end, or for `timeout` seconds. Closing a socket
        with unread bytes in it resets the connection, and a reset can make the peer drop frames
        it has received but not read yet: the last words of a failing core."""
        deadline = time.monotonic() + timeout
        try:
            self._sock.shutdown(socket.SHUT_WR)
            while (remaining := deadline - time.monotonic()) > 0:
                readable, _, _ = select.select([self._sock], [], [], remaining)
                if readable and not self._sock.recv(1 << 16):
                    return
        except OSError:
            return  # the peer is gone already

    def recv(self):
        """The next message; raises ChannelClosed when the peer closed the socket."""
        length = self._codec.body_length(self._recv_exact(HEADER_BYTES))
        return self._codec.decode_body(self._recv_exact(length))

    def _recv_exact(self, num_bytes: int) -> bytes:
        chunks, remaining = [], num_bytes
        while remaining:
            try:
                chunk = self._sock.recv(min(remaining, 1 << 20))
            except ConnectionError as exc:
                raise ChannelClosed(f"peer closed the engine socket ({exc})") from exc
            if not chunk:
                raise ChannelClosed("peer closed the engine socket")
            chunks.append(chunk)
            remaining -= len(chunk)
        return b"".join(chunks)

    def fileno(self) -> int:
        return self._sock.fileno()

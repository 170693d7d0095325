"""The server's handle on its engine-core process (asyncio side of the socketpair).

`spawn_core()` starts the engine-core process (`python -m hearth.server.core_main`, which picks
the KV connector by the config's role) and hands it the EngineConfig at once; `start()` adopts
that process (or spawns one) and returns at once; a background task waits for EngineReady, so
`/health` answers "loading" meanwhile. `hearth serve` spawns the core before it imports its HTTP
stack (hearth/cli.py), so the engine's imports and model load overlap the server's own start.
`add()` sends an AddRequest and waits for the core's AddResult, so a refused request (prompt too
long, invalid schema) becomes a 400 before any response byte is sent. Outputs then flow into
that request's queue until its finished output arrives.

Invariant: every request added is either finished by the engine, aborted through `abort()`, or
failed here when the core process dies; no waiter is ever left hanging. A core whose loop fails
ends its open requests with error outputs and exits (hearth/engine/core_process.py); whatever it
could not answer (requests still in the socket, load queries) fails here the moment the socket
closes: the add waiters raise EngineDeadError, each output queue gets a final error output, and
`failure` is set (`/health` answers 503 and the worker stops, hearth/server/worker_app.py). A
channel that cannot be trusted (a malformed frame) is closed from this side, so the core exits too.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
import subprocess
import sys
from dataclasses import dataclass
from typing import Callable

from hearth.config import EngineConfig
from hearth.engine.kv.transfer_api import KVTransfer
from hearth.engine.core_messages import (
    HEADER_BYTES,
    AbortRequests,
    AddRequest,
    AddResult,
    EngineFailed,
    EngineReady,
    FrameCodec,
    FromCore,
    LoadReply,
    QueryLoad,
    Shutdown,
    StartEngine,
    StepOutputs,
)
from hearth.engine.refusals import Rejection
from hearth.engine.request import RequestOutput
from hearth.engine.sampling_params import SamplingParams
from hearth.engine.stats import EngineStats
from hearth.server import core_main

log = logging.getLogger("hearth.server.engine")


class EngineDeadError(RuntimeError):
    """The engine-core process is gone (or never came up)."""


class EngineRejectedError(ValueError):
    """The engine refused a request; `rejection` says why and which field (a 400)."""

    def __init__(self, rejection: Rejection) -> None:
        super().__init__(rejection.message)
        self.rejection = rejection


@dataclass
class _Pending:
    queue: asyncio.Queue
    accepted: asyncio.Future


@dataclass
class CoreProcess:
    """An engine-core process that has been sent its StartEngine, and the server's end of
    their socketpair. Owned by whoever holds it until an EngineClient adopts it."""

    process: subprocess.Popen
    sock: socket.socket

    def kill(self) -> None:
        """End a core no EngineClient adopted (the server failed before it could)."""
        self.sock.close()
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


def spawn_core(config: EngineConfig, log_level: str = "INFO") -> CoreProcess:
    """Start the engine-core process and send it StartEngine(config): it imports torch and loads
    the model while the caller goes on (the frame waits in the socket buffer)."""
    parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    child_fd = child_sock.fileno()
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", core_main.__name__, "--fd", str(child_fd),
             "--log-level", log_level],
            pass_fds=(child_fd,),
        )
    except BaseException:
        parent_sock.close()
        raise
    finally:
        child_sock.close()
    parent_sock.sendall(FrameCodec(FromCore).encode(StartEngine(config)))
    return CoreProcess(process, parent_sock)


class EngineClient:
    def __init__(self, config: EngineConfig, log_level: str = "INFO",
                 on_dead: Callable[[str], None] | None = None,
                 core: CoreProcess | None = None) -> None:
        """`core`: a process `spawn_core(config)` already started (adopted here); None: `start()`
        spawns one."""
        self.config = config
        self.log_level = log_level
        self.on_dead = on_dead  # called once, with the reason, when the core process is lost
        self._core = core
        self.info: EngineReady | None = None
        self.stats = EngineStats()
        self.failure: str | None = None
        self._codec = FrameCodec(FromCore)
        self._process: subprocess.Popen | None = None
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._requests: dict[str, _Pending] = {}
        self._queries: dict[int, asyncio.Future] = {}
        self._query_ids = itertools.count()
        self._ready = asyncio.Event()
        self._read_task: asyncio.Task | None = None
        self._closing = False

    # ---- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        core, self._core = self._core or spawn_core(self.config, self.log_level), None
        self._process = core.process
        self._reader, self._writer = await asyncio.open_unix_connection(sock=core.sock)
        self._read_task = asyncio.create_task(self._read_loop(), name="engine-reader")

    async def wait_ready(self) -> EngineReady:
        await self._ready.wait()
        if self.info is None:
            raise EngineDeadError(self.failure or "engine failed to start")
        return self.info

    @property
    def is_ready(self) -> bool:
        return self.info is not None and self.failure is None

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def begin_shutdown(self) -> None:
        """A normal shutdown began (a signal): the core process may end from now on."""
        self._closing = True

    async def close(self, timeout: float = 10.0) -> None:
        self._closing = True
        if self._core is not None:  # never started: the adopted core has no reader yet
            self._core.kill()
            self._core = None
        if self._writer is not None and not self._writer.is_closing():
            try:
                self._send(Shutdown())
                await self._writer.drain()
                self._writer.close()
            except (ConnectionError, RuntimeError):
                pass
        if self._process is not None:
            try:
                await asyncio.to_thread(self._process.wait, timeout)
            except subprocess.TimeoutExpired:
                self._process.kill()
                await asyncio.to_thread(self._process.wait)
        if self._read_task is not None:
            self._read_task.cancel()
        self._fail_everything("server is shutting down")

    # ---- requests -------------------------------------------------------------------------

    def add_nowait(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                   queue: asyncio.Queue, kv_transfer: KVTransfer | None = None,
                   output_token_ids: list[int] = ()) -> asyncio.Future:
        """Register and send a request; the returned future resolves when the core accepted it
        (or raises EngineRejectedError / EngineDeadError). Outputs arrive on `queue` (the choices
        of one HTTP request share one). `output_token_ids`: a resumed stream's output so far."""
        if not self.is_ready:
            raise EngineDeadError(self.failure or "engine is not ready")
        # Encode first: a message that cannot be encoded is refused before anything is registered.
        frame = self._codec.encode(AddRequest(request_id, list(prompt_token_ids), params, kv_transfer,
                                              list(output_token_ids)))
        accepted = asyncio.get_running_loop().create_future()
        self._requests[request_id] = _Pending(queue=queue, accepted=accepted)
        try:
            self._write(frame)
        except BaseException:
            self._requests.pop(request_id, None)
            raise
        return accepted

    async def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                  kv_transfer: KVTransfer | None = None) -> asyncio.Queue:
        """Submit one request and wait until it is accepted; returns its output queue."""
        queue: asyncio.Queue = asyncio.Queue()
        accepted = self.add_nowait(request_id, prompt_token_ids, params, queue, kv_transfer)
        try:
            await accepted
        except BaseException:
            self.abort([request_id])
            self.forget(request_id)
            raise
        return queue

    def abort(self, request_ids: list[str]) -> None:
        """Ask the core to abort; their final (abort) outputs still arrive on their queues."""
        live = [r for r in request_ids if r in self._requests]
        if live and self.is_ready:
            self._send(AbortRequests(live))

    def forget(self, request_id: str) -> None:
        """Stop routing outputs to a request whose consumer has gone (after abort)."""
        self._requests.pop(request_id, None)

    async def load(self, check_pool: bool = False, events_since: int | None = None) -> LoadReply:
        if not self.is_ready:
            raise EngineDeadError(self.failure or "engine is not ready")
        query_id = next(self._query_ids)
        frame = self._codec.encode(QueryLoad(query_id, check_pool, events_since))
        future = asyncio.get_running_loop().create_future()
        self._queries[query_id] = future
        try:  # answered, failed, or cancelled (the caller left): the entry goes either way
            self._write(frame)
            return await future
        finally:
            self._queries.pop(query_id, None)

    # ---- socket ---------------------------------------------------------------------------

    def _send(self, message) -> None:
        self._write(self._codec.encode(message))

    def _write(self, frame: bytes) -> None:
        assert self._writer is not None
        self._writer.write(frame)

    async def _read_loop(self) -> None:
        assert self._reader is not None
        try:
            while True:
                header = await self._reader.readexactly(HEADER_BYTES)
                body = await self._reader.readexactly(self._codec.body_length(header))
                self._dispatch(self._codec.decode_body(body))
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            reason = f"engine process exited ({exc.__class__.__name__})"
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a malformed frame: the channel can no longer be trusted
            log.exception("engine channel failed")
            reason = f"engine channel failed: {exc}"
        if self._writer is not None:
            self._writer.close()  # the core reads EOF: a failed one exits without waiting for
            # us to read its last words (it half-closed first), a running one exits too
        code = self._process.poll() if self._process else None
        self._mark_dead(reason if code is None else f"{reason}, exit code {code}")

    def _dispatch(self, message) -> None:
        if isinstance(message, StepOutputs):
            self.stats = message.stats
            for output in message.outputs:
                pending = self._requests.get(output.request_id)
                if pending is not None:
                    if not pending.accepted.done():  # the core answers AddResult first; should
                        pending.accepted.set_result(None)  # it not, the waiter still gets this
                    pending.queue.put_nowait(output)
                    if output.finished:
                        self._requests.pop(output.request_id, None)
        elif isinstance(message, AddResult):
            self._on_add_result(message)
        elif isinstance(message, LoadReply):
            self.stats = message.stats
            future = self._queries.pop(message.query_id, None)
            if future is not None and not future.done():
                future.set_result(message)
        elif isinstance(message, EngineReady):
            self.info, self.stats = message, message.stats
            log.info("engine ready: %s (%.1fs)", message.model_name, message.load_seconds)
            self._ready.set()
        elif isinstance(message, EngineFailed):
            self._mark_dead(f"engine failed to start: {message.message}")

    def _on_add_result(self, message: AddResult) -> None:
        pending = self._requests.get(message.request_id)
        if pending is None or pending.accepted.done():
            return
        if message.rejection is None:
            pending.accepted.set_result(None)
        else:
            self._requests.pop(message.request_id, None)
            pending.accepted.set_exception(EngineRejectedError(message.rejection))

    def _mark_dead(self, reason: str) -> None:
        first = self.failure is None
        if first:
            self.failure = reason
            log.log(logging.INFO if self._closing else logging.ERROR, "%s", reason)
        self._ready.set()
        self._fail_everything(reason)
        if first and self.on_dead is not None and not self._closing:
            self.on_dead(reason)

    def _fail_everything(self, reason: str) -> None:
        for request_id, pending in list(self._requests.items()):
            if not pending.accepted.done():
                pending.accepted.set_exception(EngineDeadError(reason))
            pending.queue.put_nowait(RequestOutput(
                request_id, [], "", finished=True, finish_reason="error", error=reason))
        self._requests.clear()
        for future in self._queries.values():
            if not future.done():
                future.set_exception(EngineDeadError(reason))
        self._queries.clear()

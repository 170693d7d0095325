"""The engine-core process: owns one LLMEngine and steps it whenever it has work.

`run_core` serves one server over its end of a private socketpair; the process's entry point is
hearth/server/core_main.py (the server starts `python -m hearth.server.core_main --fd N`, and
picks the KV connector by role there). The first message is StartEngine; the core loads the
model and answers EngineReady (or EngineFailed and exits).

Loop invariant: between two engine steps every command that has arrived is applied, so an abort
or a new request waits at most one step; with no work the loop blocks on the socket (no spin;
it wakes once a second to look for a lost rank).

Failures (the server never waits on a request the core has stopped serving):
- A request the engine refuses or fails to add gets its AddResult with the reason; nothing else.
- An exception that escapes `engine.step()` (the engine isolates per-request failures itself)
  ends the requests in flight with an error, aborts them (their blocks return to the pool) and
  runs one more step to drain the aborts; the loop goes on: one bad step never takes the process
  down. When that recovery fails too, the fault is not one step's: it is fatal, as below.
- Any other exception in the loop (decoding a message, applying a command, the idle wait,
  answering deferred requests, building, encoding or sending a step's outputs, the stats and
  the KV hooks a load query runs) is fatal: every open request ends with an error output (a
  request still waiting for its AddResult is accepted first, so its waiter reads the error),
  the engine aborts them where it still can, the traceback is logged, and the process exits
  with code 4. A lost rank (`RankFailedError`: a tensor/pipeline-parallel rank died or stopped
  answering) ends the open requests the same way without touching the engine and exits with
  code 3. The server then stops too (hearth/server/engine_client.py fails whatever is left when
  the socket closes), and a supervisor (`hearth up`, a cluster controller) replaces the worker.
- The process exits with code 0 when the server closes the socket or sends Shutdown.

A guided request whose grammar is still compiling gets its AddResult only when the compile ends
(the engine's `admissions`): a bad or too-slow grammar is then a rejection (a 400), and the
server sees every AddResult before any output of that request.
"""

from __future__ import annotations

import logging
import select
import socket
import time
from typing import TYPE_CHECKING, Callable, NoReturn

from hearth.engine.core_messages import (
    AbortRequests,
    AddRequest,
    AddResult,
    BlockingChannel,
    ChannelClosed,
    EngineFailed,
    EngineReady,
    LoadReply,
    QueryLoad,
    Shutdown,
    StartEngine,
    StepOutputs,
    ToCore,
)
from hearth.engine.refusals import Rejection
from hearth.engine.request import RequestOutput
from hearth.engine.stats import EngineStats

if TYPE_CHECKING:
    from hearth.config import EngineConfig
    from hearth.engine.kv.transfer_api import ConnectorFactory

log = logging.getLogger("hearth.core")

IDLE_WAKE_SECONDS = 1.0  # an idle core looks at its rank set this often
# Step outputs carry the per-expert token counts (MoE metrics) at most this often, and whenever
# a request ends (so the totals are exact once a request is answered).
EXPERT_LOAD_PERIOD_S = 1.0
# A failed core waits this long at most for the server to read its last outputs and close.
LAST_WORDS_SECONDS = 5.0


class EngineCore:
    """Applies commands to the engine and reports its outputs over the channel."""

    def __init__(self, engine, channel: BlockingChannel) -> None:
        self.engine = engine
        self.channel = channel
        self.live_request_ids: set[str] = set()
        self.unanswered_ids: set[str] = set()  # added, AddResult deferred until the grammar compiles
        self.running = True
        self._experts_sent = float("-inf")  # when step outputs last carried the expert counts

    def handle(self, message: ToCore) -> None:
        if isinstance(message, AddRequest):
            self._add(message)
        elif isinstance(message, AbortRequests):
            for request_id in message.request_ids:
                if request_id in self.live_request_ids:
                    self.engine.abort_request(request_id)
        elif isinstance(message, QueryLoad):
            whole = self.engine.kv_pool_is_whole() if message.check_pool else None
            report = LoadReply(message.query_id, self.engine.stats(), whole)
            if message.events_since is not None:
                report.events_cursor, report.stored_hashes, report.evicted_hashes = \
                    self.engine.block_events_since(message.events_since)
                report.tier_hashes = {tier: [stored, evicted] for tier, (stored, evicted) in
                                      self.engine.tier_block_events_since(
                                          message.events_since).items()}
            self.channel.send(report)
        elif isinstance(message, Shutdown):
            self.running = False
        else:
            log.error("unexpected message %s", type(message).__name__)

    def _add(self, message: AddRequest) -> None:
        extra = {} if message.kv_transfer is None else {"kv_transfer": message.kv_transfer}
        if message.output_token_ids:
            extra["output_token_ids"] = message.output_token_ids
        try:
            self.engine.add_request(message.request_id, message.prompt_token_ids, message.params, **extra)
        except ValueError as exc:
            self.channel.send(AddResult(message.request_id, Rejection.of(exc)))
            return
        except Exception as exc:  # an engine bug on one request must not end the loop
            log.exception("add_request %s failed", message.request_id)
            self.channel.send(AddResult(message.request_id, Rejection(f"internal error: {exc}")))
            return
        self.live_request_ids.add(message.request_id)
        if self.engine.is_waiting_for_grammar(message.request_id):
            self.unanswered_ids.add(message.request_id)
        else:
            self.channel.send(AddResult(message.request_id))

    def step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            if _rank_set_lost(exc):
                raise  # serve() ends every request and exits
            outputs = self._recover(exc)
        outputs = self._answer_deferred(outputs)
        ended = False
        for output in outputs:
            if output.finished:
                self.live_request_ids.discard(output.request_id)
                ended = True
        if outputs:
            now = time.monotonic()
            experts = ended or now - self._experts_sent >= EXPERT_LOAD_PERIOD_S
            if experts:
                self._experts_sent = now
            self.channel.send(StepOutputs(outputs, self.engine.stats(expert_load=experts)))

    def _recover(self, exc: Exception) -> list[RequestOutput]:
        """One step failed: its requests in flight end with the error and are aborted, and one
        more step drains the aborts (their outputs are superseded by the errors). An exception
        here (an abort, or the draining step failing as well) escapes to serve(): the fault is
        not one step's, so the core is done."""
        log.exception("engine step failed; ending the %d requests in flight",
                      len(self.live_request_ids))
        error = f"{type(exc).__name__}: {exc}"
        failed = [RequestOutput(request_id, [], "", finished=True, finish_reason="error",
                                error=error) for request_id in sorted(self.live_request_ids)]
        for output in failed:
            self.engine.abort_request(output.request_id)
        self.engine.step()
        return failed

    def _answer_deferred(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Send the deferred AddResults of requests whose grammar wait ended (a rejection
        replaces the request's error output) or that finish anyway (aborted meanwhile)."""
        for request_id, rejection in self.engine.admissions:
            if request_id not in self.unanswered_ids:
                continue
            self.unanswered_ids.discard(request_id)
            self.channel.send(AddResult(request_id, rejection))
            if rejection is not None:
                self.live_request_ids.discard(request_id)
                outputs = [o for o in outputs if o.request_id != request_id]
        for output in outputs:
            if output.request_id in self.unanswered_ids:
                self.unanswered_ids.discard(output.request_id)
                self.channel.send(AddResult(output.request_id))
        return outputs

    def serve(self) -> None:
        """Run until Shutdown; raises ChannelClosed when the server has gone, and CoreFailed
        (after ending every open request) when the loop itself failed (see the module doc)."""
        try:
            self._loop()
        except (ChannelClosed, CoreFailed):
            raise
        except Exception as exc:
            if _rank_set_lost(exc):
                self._end_all(exc, RankSetLost)
            self._end_all(exc, CoreFailed)

    def _loop(self) -> None:
        while self.running:
            busy = self.engine.has_unfinished()
            for message in self._pending_messages(wait=not busy):
                self.handle(message)
            # A rank lost while idle: exit now, not on the next request (the heartbeat set it).
            failure = self.engine.fatal_error()
            if failure:
                raise _rank_failed_error(failure)
            if self.running and self.engine.has_unfinished():
                self.step()

    def _end_all(self, exc: Exception, failure: type[CoreFailed]) -> NoReturn:
        """The core cannot go on: every open request ends with the error, then `failure` is
        raised (this process exits). A request still waiting for its AddResult is accepted
        first, so the server's waiter reads the error. After a lost rank the engine is left
        alone (it cannot run anything); otherwise its requests are aborted, so their blocks
        return to the pool as far as the engine still can."""
        request_ids = sorted(self.live_request_ids)
        log.error("engine core %s; ending the %d open requests and exiting",
                  "lost its rank set" if failure is RankSetLost else "failed",
                  len(request_ids), exc_info=exc)
        error = f"{type(exc).__name__}: {exc}"
        if failure is not RankSetLost:
            for request_id in request_ids:
                try:
                    self.engine.abort_request(request_id)
                except Exception:
                    log.exception("abort of %s failed", request_id)
        for request_id in sorted(self.unanswered_ids):
            self._send_last_words(AddResult(request_id))
        if request_ids:
            failed = [RequestOutput(request_id, [], "", finished=True, finish_reason="error",
                                    error=error) for request_id in request_ids]
            self._send_last_words(StepOutputs(failed, self._stats_or_empty()))
        self.live_request_ids.clear()
        self.unanswered_ids.clear()
        raise failure(error) from exc

    def _send_last_words(self, message) -> None:
        try:
            self.channel.send(message)
        except Exception:  # the server sees the socket close and fails the rest itself
            log.exception("could not send %s to the server", type(message).__name__)

    def _stats_or_empty(self) -> EngineStats:
        try:
            return self.engine.stats(expert_load=False)
        except Exception:
            log.exception("engine stats failed")
            return EngineStats()

    def _pending_messages(self, wait: bool):
        """Messages already arrived (or, with `wait`, block up to IDLE_WAKE_SECONDS for one)."""
        timeout = IDLE_WAKE_SECONDS if wait else 0.0
        while True:
            readable, _, _ = select.select([self.channel], [], [], timeout)
            if not readable:
                return
            yield self.channel.recv()
            timeout = 0.0


class CoreFailed(RuntimeError):
    """The core loop failed outside one request's isolation: the process exits (module doc)."""

    exit_code = 4


class RankSetLost(CoreFailed):
    """The engine's rank set is gone: the core process exits (see the module doc)."""

    exit_code = 3


def _rank_set_lost(exc: BaseException) -> bool:
    # torch: loaded with the engine by now
    from hearth.engine.parallel.distributed import RankFailedError

    return isinstance(exc, RankFailedError)


def _rank_failed_error(failure: str) -> Exception:
    from hearth.engine.parallel.distributed import RankFailedError

    return RankFailedError(failure)


ConnectorChoice = Callable[["EngineConfig"], "ConnectorFactory | None"]


def run_core(sock: socket.socket, connector_factory_for: ConnectorChoice | None = None,
             store_factory_for: Callable | None = None) -> int:
    """Serve one server over `sock`. `connector_factory_for(config)` is the KV connector
    factory for the engine StartEngine describes (None: no connector); the server's entry
    point (hearth/server/core_main.py) chooses it by role. `store_factory_for(config)` is
    likewise the KV-tier store factory (None: no tiers below the pool)."""
    from hearth.engine.core_messages import ToCore as incoming
    from hearth.engine.engine import LLMEngine

    channel = BlockingChannel(sock, incoming)
    start = channel.recv()
    if not isinstance(start, StartEngine):
        log.error("first message must be StartEngine, got %s", type(start).__name__)
        return 2
    try:
        factory = connector_factory_for(start.config) if connector_factory_for else None
        stores = store_factory_for(start.config) if store_factory_for else None
        engine = LLMEngine(start.config, connector_factory=factory, store_factory=stores)
    except Exception as exc:
        log.exception("engine failed to start")
        try:
            channel.send(EngineFailed(f"{type(exc).__name__}: {exc}"))
        except OSError:
            pass  # the server is already gone
        return 1
    return serve_engine(engine, channel)


def serve_engine(engine, channel: BlockingChannel) -> int:
    """Announce a started engine (EngineReady) and run the core loop until the server leaves;
    returns the process's exit code (module doc)."""
    channel.send(EngineReady(
        model_name=engine.model_name,
        max_model_len=engine.max_model_len,
        vocab_size=int(engine.arch.vocab_size),
        block_size=int(engine.block_size),
        load_seconds=float(engine.load_seconds),
        stats=engine.stats(),
    ))
    try:
        EngineCore(engine, channel).serve()
    except ChannelClosed:
        log.info("server closed the engine socket; exiting")
    except CoreFailed as exc:
        channel.finish(LAST_WORDS_SECONDS)
        return exc.exit_code
    return 0

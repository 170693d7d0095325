"""Grammar admission: guided requests wait here, outside the scheduler, until their grammar compiles.

A request with a `guided` spec whose grammar is not cached yet must not hold KV blocks or be
scheduled while the grammar pool compiles it on another thread. `GrammarAdmission` parks it
(`park`) with what its admission still needs (its PD transfer and handle, a resumed output);
each engine step admits the parked requests whose compile ended (`admit_resolved`): into the
scheduler with their matcher, or finished with the error, each outcome recorded in
`admissions` so the engine core accepts or rejects the request only once its grammar is known. Aborting a
parked request releases its ticket; nothing else was allocated for it.

The grammar pool itself (compiler, cache, threads) is built on the first guided request, so an
engine that never sees one never imports the grammar backend.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from hearth.config import GuidedConfig
from hearth.engine.guided.grammar_pool import GrammarPool, GrammarTicket
from hearth.engine.kv.transfer_api import KVTransfer
from hearth.engine.refusals import Rejection
from hearth.engine.request import Request, RequestOutput, RequestStatus


@dataclass
class GrammarWait:
    """A request parked until its grammar compiles, with what admission still needs."""

    request: Request
    ticket: GrammarTicket
    kv_transfer: KVTransfer | None
    kv_handle: Any
    output_token_ids: list[int]


class GrammarAdmission:
    def __init__(self, make_compiler: Callable[[], Any], config: GuidedConfig) -> None:
        self._make_compiler, self._config = make_compiler, config
        self._pool: GrammarPool | None = None  # built on the first guided request
        self._waits: dict[str, GrammarWait] = {}
        # (request_id, rejection or None) of each wait the last step ended; a rejected request
        # also had a finished "error" output in that step.
        self.admissions: list[tuple[str, Rejection | None]] = []

    @property
    def pool(self) -> GrammarPool:
        if self._pool is None:
            self._pool = GrammarPool(self._make_compiler(), self._config)
        return self._pool

    def attach(self, req: Request) -> GrammarTicket | None:
        """Submit a guided request's grammar; a cached one gives `req` its matcher at once.
        The ticket when the request must wait for a compile (then `park` it), else None."""
        if req.params.guided is None:
            return None
        ticket = self.pool.submit(req.params.guided)
        if ticket.is_compiled():
            req.grammar = self.pool.matcher(ticket)
            return None
        return ticket

    def park(self, req: Request, ticket: GrammarTicket, kv_transfer: KVTransfer | None,
             kv_handle, output_token_ids: list[int]) -> None:
        req.status = RequestStatus.WAITING_FOR_GRAMMAR
        self._waits[req.request_id] = GrammarWait(req, ticket, kv_transfer, kv_handle,
                                                  output_token_ids)

    def admit_resolved(self, enqueue: Callable[[GrammarWait], RequestOutput | None],
                       fail: Callable[[Request], RequestOutput]) -> list[RequestOutput]:
        """One step's admission: each parked request whose compile ended leaves the waits;
        a compiled one gets its matcher and goes to `enqueue` (the scheduler; a resumed
        request's first output comes back), a failed one (bad spec, timeout, or a refusal
        from `enqueue`) is finished with the error by `fail`. Sets `admissions`; returns the
        outputs in order."""
        self.admissions = []
        outputs = []
        now = time.monotonic()
        for request_id, wait in list(self._waits.items()):
            if not wait.ticket.is_resolved(now):
                continue
            del self._waits[request_id]
            req, rejection = wait.request, None
            try:
                req.grammar = self.pool.matcher(wait.ticket)
                req.status = RequestStatus.WAITING
                resumed = enqueue(wait)
                if resumed is not None:
                    outputs.append(resumed)
            except ValueError as exc:
                rejection = Rejection.of(exc)
                req.status, req.error = RequestStatus.FINISHED_ERROR, rejection.message
                outputs.append(fail(req))
            self.admissions.append((request_id, rejection))
        return outputs

    def abort(self, request_id: str) -> Request | None:
        """Drop a parked request (its ticket released; it held nothing else); None if the
        request is not waiting here."""
        wait = self._waits.pop(request_id, None)
        if wait is None:
            return None
        self.pool.release(wait.ticket)
        return wait.request

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._waits

    def __len__(self) -> int:
        return len(self._waits)

    def wait(self, timeout: float) -> None:
        """Block up to `timeout` for a compile to end (the engine has nothing else to run)."""
        self.pool.wait(timeout)

    @property
    def num_compiling(self) -> int:
        return self._pool.num_in_flight if self._pool is not None else 0

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()

"""The engine-side half of prefill/decode disaggregation, driving a `KVConnector`.

Invariants:
  * every block reference a prefill request held at its finish is either freed by the engine or
    owned by exactly one lease, and a lease's blocks come back through `poll` exactly once;
  * a decode request's blocks are written by at most one transfer, and are freed or read by the
    model only after the connector reported that transfer done (an abort meanwhile only marks
    the request; `Scheduler.complete_import` frees it);
  * a decode request computes none of the prompt tokens it received: after a successful import
    `num_computed_tokens == num_prompt_tokens`, and its first step computes the first token.
"""

from __future__ import annotations

import logging

from hearth.config import Role
from hearth.engine.kv.transfer_api import ImportResult, KVConnector, KVTransfer
from hearth.engine.kv.cache import KVCacheManager, cdiv
from hearth.engine.refusals import RequestRejected
from hearth.engine.request import Request
from hearth.engine.sampling_params import SamplingParams
from hearth.engine.scheduler import Scheduler

log = logging.getLogger("hearth.engine.kv.transfer")

class KVTransferDriver:
    def __init__(self, connector: KVConnector, scheduler: Scheduler, kv: KVCacheManager,
                 vocab_size: int) -> None:
        self.connector = connector
        self.scheduler = scheduler
        self.kv = kv
        self.vocab_size = vocab_size
        self.imports: dict[str, Request] = {}  # request_id -> request whose transfer is running
        self.counters = dict(transferred_tokens=0, transferred_blocks=0, transferred_bytes=0,
                             transfer_failures=0, exports=0)

    # ---- admission --------------------------------------------------------------------------
    def check(self, transfer: KVTransfer, prompt_token_ids: list[int],
              params: SamplingParams) -> object | None:
        """Validate a request's spec before anything is built (RequestRejected names the field)."""
        if transfer.role is Role.PREFILL:
            if params.max_tokens != 1:
                raise RequestRejected("kv_transfer", "kv_transfer: a prefill hop samples exactly "
                                      "one token (max_tokens=1, n=1)")
            self.connector.check_export(transfer.transfer_id)
            return None
        first = transfer.first_token_id
        if not isinstance(first, int) or not 0 <= first < self.vocab_size:
            raise RequestRejected("kv_transfer.first_token_id", f"kv_transfer.first_token_id: must "
                                  f"be a token id in [0, {self.vocab_size}), got {first!r}")
        if params.max_tokens < 2:
            raise RequestRejected("max_tokens", "max_tokens: a decode hop continues after the "
                                  "first token, so it needs max_tokens >= 2 (the first token "
                                  "counts)")
        return self.connector.check_import(transfer, prompt_token_ids)

    def attach(self, req: Request, transfer: KVTransfer, handle: object | None) -> None:
        """Mark the request; a decode request gets the first token the prefill side sampled."""
        req.kv_transfer = transfer
        if transfer.role is Role.DECODE:
            first = transfer.first_token_id
            if req.grammar is not None and not req.grammar.accept(first):
                raise RequestRejected("kv_transfer.first_token_id", f"kv_transfer.first_token_id: "
                                      f"{first} violates the response format")
            req.append_token(first)
            req.kv_import = handle

    # ---- export (prefill side) ------------------------------------------------------------
    def export(self, req: Request) -> None:
        """At a normal finish, move the prompt's block references under a lease and record the
        descriptor, instead of freeing them."""
        num_tokens = req.num_prompt_tokens
        assert req.num_computed_tokens >= num_tokens, req
        hashes = self.kv.update_block_hashes(req)[: num_tokens // self.kv.block_size]
        block_ids = self.kv.detach(req)
        keep = cdiv(num_tokens, self.kv.block_size)
        self.kv.free_block_ids(block_ids[keep:])  # none in practice: the first token has no KV
        block_ids = block_ids[:keep]
        try:
            req.kv_descriptor = self.connector.export(req.kv_transfer.transfer_id, block_ids,
                                                      hashes, req.prompt_token_ids)
        except BaseException:
            self.kv.free_block_ids(block_ids)
            raise
        self.counters["exports"] += 1

    # ---- import (decode side) -------------------------------------------------------------
    def start_imports(self, reqs: list[Request]) -> None:
        for req in reqs:
            first = req.num_computed_tokens // self.kv.block_size  # after the local prefix hits
            positions = list(range(first, cdiv(req.num_prompt_tokens, self.kv.block_size)))
            self.imports[req.request_id] = req
            try:
                self.connector.start_import(req.request_id, req.kv_import, positions,
                                            [req.block_ids[i] for i in positions])
            except Exception as exc:  # nothing was started: recompute instead
                log.exception("could not start the import of %s", req.request_id)
                self._complete(ImportResult(req.request_id, ok=False, error=str(exc)))

    def poll(self) -> None:
        """Apply what the connector finished: free released leases, resume imported requests."""
        events = self.connector.poll()
        for block_ids in events.released_block_ids:
            self.kv.free_block_ids(block_ids)
        for result in events.imports:
            self._complete(result)

    def _complete(self, result: ImportResult) -> None:
        req = self.imports.pop(result.request_id)
        num_computed = req.num_computed_tokens  # the local prefix hits
        if result.ok:
            req.num_transferred_tokens = req.num_prompt_tokens - num_computed
            req.num_transferred_blocks = result.num_blocks
            req.num_transferred_bytes = result.num_bytes
            num_computed = req.num_prompt_tokens
            self.counters["transferred_tokens"] += req.num_transferred_tokens
            self.counters["transferred_blocks"] += result.num_blocks
            self.counters["transferred_bytes"] += result.num_bytes
        elif not req.is_finished:
            # Fallback: the request computes the rest of its prompt here, as a monolithic
            # worker would (the connector left the blocks zeroed).
            self.counters["transfer_failures"] += 1
            log.warning("KV import of %s failed (%s); recomputing %d prompt tokens locally",
                        req.request_id, result.error, req.num_prompt_tokens - num_computed)
        self.scheduler.complete_import(req, num_computed)
        if not req.is_finished:
            self.kv.register_computed_blocks(req)

    def abort(self, req: Request) -> None:
        """A decode request aborted before its import started: release the remote lease now."""
        if req.kv_import is not None and req.request_id not in self.imports:
            self.connector.reject(req.kv_import)
            req.kv_import = None

    def wait(self, timeout: float) -> None:
        """Called when a step had nothing to compute: sleep until a transfer may be done."""
        if self.imports:
            self.connector.wait(timeout)

    def num_leases(self) -> int:
        return self.connector.num_leases()

    def close(self) -> None:
        self.connector.close()
        self.poll()

"""Grammar compiles off the engine loop: a few worker threads and a cache of compiled grammars.

xgrammar's compiler does its work in C++ with the GIL released, so the engine loop keeps
stepping other requests while a grammar compiles. `submit` checks the spec's limits (cheap, on
the caller's thread) and returns a ticket; the engine polls tickets each step.

Invariants:
- at most `max_compiles_in_flight` compiles are queued or running; past that `submit` refuses
  (a compile that timed out still counts until its thread ends: a thread cannot be killed);
- a spec compiles once while it is cached: identical specs (same canonical key) share one
  compile, and a later one gets the finished grammar at once;
- failed compiles are not cached; a compile nobody waits for any more is cancelled if it
  has not started.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass

from typing import TYPE_CHECKING

from hearth.config import GuidedConfig
from hearth.engine.guided.limits import param_of, spec_key
from hearth.engine.refusals import RequestRejected
from hearth.engine.sampling_params import GuidedSpec

if TYPE_CHECKING:  # xgrammar (via guided) costs ~0.7 s to import: only once a grammar is needed
    from hearth.engine.guided.grammar import GrammarCompiler, Matcher


@dataclass
class _Entry:
    future: Future  # -> xgr.CompiledGrammar
    num_waiting: int = 0  # tickets not yet resolved or released


@dataclass
class GrammarTicket:
    """One request's wait for its grammar."""

    key: tuple[str, str]
    entry: _Entry
    deadline: float  # monotonic time after which the request fails
    timeout_s: float

    def is_compiled(self) -> bool:
        """The compile ended (successfully or not)."""
        return self.entry.future.done()

    def is_resolved(self, now: float) -> bool:
        """The compile ended or the wait timed out."""
        return self.entry.future.done() or now >= self.deadline


class GrammarPool:
    def __init__(self, compiler: GrammarCompiler, config: GuidedConfig, clock=time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._vocab_size = compiler.vocab_size
        self._compilers = threading.local()  # one xgrammar compiler per worker thread
        self._template = compiler
        self._executor = ThreadPoolExecutor(config.num_compile_threads,
                                            thread_name_prefix="grammar-compile")
        self._lock = threading.Lock()  # guards _cache and _num_in_flight (done callbacks)
        self._cache: OrderedDict[tuple[str, str], _Entry] = OrderedDict()
        self._num_in_flight = 0
        self._finished = threading.Event()  # set whenever a compile ends
        self.counters = dict(hits=0, misses=0, failures=0, timeouts=0)

    @property
    def num_in_flight(self) -> int:
        """Compiles queued or running."""
        with self._lock:
            return self._num_in_flight

    @property
    def num_cached(self) -> int:
        with self._lock:
            return len(self._cache)

    def submit(self, spec: GuidedSpec) -> GrammarTicket:
        """Start (or join, or reuse) the compile of `spec`. ValueError: over a limit, or too many
        compiles in flight."""
        key = spec_key(spec, self.config)
        new = None
        with self._lock:
            entry = self._cache.get(key)
            if entry is not None:
                self._cache.move_to_end(key)
                self.counters["hits"] += 1
            else:
                if self._num_in_flight >= self.config.max_compiles_in_flight:
                    param = param_of(spec.kind)
                    raise RequestRejected(param, f"{param}: {self._num_in_flight} grammars are "
                                          f"compiling, the most this worker allows; retry later")
                self.counters["misses"] += 1
                self._num_in_flight += 1
                entry = new = _Entry(self._executor.submit(self._compile, GuidedSpec(*key)))
                self._cache[key] = entry
                self._evict()
            entry.num_waiting += 1
        if new is not None:  # outside the lock: runs at once if the compile already ended
            new.future.add_done_callback(lambda _, key=key: self._on_done(key, new))
        timeout = self.config.compile_timeout_s
        return GrammarTicket(key, entry, self._clock() + timeout, timeout)

    def matcher(self, ticket: GrammarTicket) -> Matcher:
        """The resolved ticket's matcher; ValueError if its compile failed or timed out."""
        self._release(ticket)
        future = ticket.entry.future
        param = param_of(ticket.key[0])
        if not future.done():
            self.counters["timeouts"] += 1
            raise RequestRejected(param, f"{param}: the grammar did not compile within "
                                  f"{ticket.timeout_s:g} s; simplify the schema")
        try:
            from hearth.engine.guided.grammar import Matcher

            return Matcher(future.result(), self._vocab_size, self.config.jump_forward)
        except CancelledError:
            raise RequestRejected(param, f"{param}: the grammar compile was cancelled") from None
        except ValueError as exc:
            raise RequestRejected(param, f"{param}: {exc}") from None

    def release(self, ticket: GrammarTicket) -> None:
        """The request no longer waits (aborted): cancel its compile if nobody else needs it."""
        if self._release(ticket) == 0 and ticket.entry.future.cancel():
            with self._lock:
                if self._cache.get(ticket.key) is ticket.entry:
                    del self._cache[ticket.key]

    def wait(self, timeout: float) -> None:
        """Block until some compile ends, or `timeout` seconds."""
        self._finished.wait(timeout)
        self._finished.clear()

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _release(self, ticket: GrammarTicket) -> int:
        with self._lock:
            ticket.entry.num_waiting -= 1
            return ticket.entry.num_waiting

    def _compile(self, spec: GuidedSpec):
        compiler = getattr(self._compilers, "compiler", None)
        if compiler is None:
            compiler = self._compilers.compiler = self._template.fork()
        return compiler.compile(spec)

    def _on_done(self, key: tuple[str, str], entry: _Entry) -> None:
        with self._lock:
            self._num_in_flight -= 1
            if entry.future.cancelled() or entry.future.exception() is not None:
                if not entry.future.cancelled():
                    self.counters["failures"] += 1
                if self._cache.get(key) is entry:
                    del self._cache[key]
        self._finished.set()

    def _evict(self) -> None:
        """Drop the least recently used finished grammars past the cache size (lock held)."""
        excess = len(self._cache) - self.config.cache_size
        for key in [k for k, e in self._cache.items() if e.future.done()][:max(0, excess)]:
            del self._cache[key]

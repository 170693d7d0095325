"""The router's picture of its workers: health, estimated load and a view of each prefix cache.

Invariants:
  * every load prediction a request adds (`Ticket`) is taken back exactly once, on every path
    (finish, error, client gone), so estimates never drift upward;
  * an endpoint's load estimate is the router's own in-flight predictions plus the load its last
    report showed beyond them (requests from elsewhere), so a burst is seen before any report;
  * a cache view holds block hashes in LRU order: added when the router sends a prompt there
    (prediction), corrected by the worker's stored/evicted reports, bounded by its block count.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterable

import msgspec

from hearth.config import Role
from hearth.router.policy import Decision, EndpointView
from hearth.server.load_report import LoadReport

DEFAULT_CACHE_BLOCKS = 1 << 16  # until the worker reports its pool size
TIER_CACHE_BLOCKS = 1 << 20  # a view of KV tiers below the pool (bounded; tiers report evictions)
SHARED_TIERS = ("shared", "mooncake")  # tiers every worker reporting one reaches


class CacheView:
    """Block hashes one endpoint is believed to hold, least recently used first."""

    def __init__(self, capacity: int = DEFAULT_CACHE_BLOCKS) -> None:
        self.capacity = capacity
        self._hashes: OrderedDict[int, None] = OrderedDict()

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._hashes

    def __len__(self) -> int:
        return len(self._hashes)

    def touch(self, block_hashes: Iterable[int]) -> None:
        """The endpoint computed or reused these blocks: they are now its most recent."""
        for block_hash in block_hashes:
            self._hashes[block_hash] = None
            self._hashes.move_to_end(block_hash)
        self._trim()

    def apply_events(self, stored: Iterable[int], evicted: Iterable[int]) -> None:
        self.touch(stored)
        for block_hash in evicted:
            self._hashes.pop(block_hash, None)

    def set_capacity(self, num_blocks: int) -> None:
        self.capacity = max(1, num_blocks)
        self._trim()

    def clear(self) -> None:
        self._hashes.clear()

    def _trim(self) -> None:
        while len(self._hashes) > self.capacity:
            self._hashes.popitem(last=False)


class TierHashes:
    """Blocks an endpoint can load instead of computing: its own lower tiers, and the shared
    tier when it has one (one view for the whole pool: every worker on it sees the same store)."""

    def __init__(self, *views: CacheView | None) -> None:
        self.views = [v for v in views if v is not None]

    def __contains__(self, block_hash: object) -> bool:
        return any(block_hash in v for v in self.views)


@dataclass
class Counters:
    routed: int = 0  # requests this endpoint served (as prefill, decode or monolithic)
    failures: int = 0  # hops that failed on it (connection, 5xx, broken stream)
    retries: int = 0  # hops moved elsewhere after failing on it
    predicted_cached_tokens: int = 0  # what the policy expected cached on it
    reported_cached_tokens: int = 0  # what its responses said was cached


@dataclass
class Endpoint:
    url: str
    role: Role
    healthy: bool = False
    ejected_until: float = 0.0  # passive ejection: not re-admitted before this (monotonic)
    last_error: str | None = None
    num_slow_checks: int = 0  # slow /load polls in a row: the report is stale (busy is not dead)
    own_prefill_tokens: int = 0  # predictions of in-flight requests the router sent here
    own_decode_tokens: int = 0
    own_requests: int = 0
    extra_prefill_tokens: int = 0  # reported load beyond the router's own (other clients)
    extra_decode_tokens: int = 0
    report: LoadReport | None = None  # the last /load report
    refusal: str | None = None  # why the router will not use it although it answers (contract)
    events_cursor: int = 0
    cache: CacheView = field(default_factory=CacheView)
    tier_cache: CacheView = field(default_factory=lambda: CacheView(TIER_CACHE_BLOCKS))
    shared_cache: CacheView | None = None  # the pool's view of the shared tier
    has_shared_tier: bool = False  # it reported blocks in a shared tier
    counters: Counters = field(default_factory=Counters)

    def __post_init__(self) -> None:
        self.role = Role.parse(self.role, f"endpoint {self.url}: role")

    @property
    def prefill_tokens(self) -> int:
        return self.own_prefill_tokens + self.extra_prefill_tokens

    @property
    def decode_tokens(self) -> int:
        return self.own_decode_tokens + self.extra_decode_tokens

    def view(self, excluded: bool = False) -> EndpointView:
        return EndpointView(self.url, self.role, self.healthy and not excluded, self.prefill_tokens,
                            self.decode_tokens, self.cache,
                            TierHashes(self.tier_cache,
                                       self.shared_cache if self.has_shared_tier else None))

    def apply_report(self, report: LoadReport, own_at_send: tuple[int, int]) -> None:
        """Correct the estimate with a /load report; `own_at_send` = own (prefill, decode)
        tokens when the query left, so predictions that finished meanwhile are not counted twice."""
        self.report = report
        self.extra_prefill_tokens = max(0, report.num_prefill_tokens_inflight
                                        - max(own_at_send[0], self.own_prefill_tokens))
        self.extra_decode_tokens = max(0, report.num_decode_tokens_active
                                       - max(own_at_send[1], self.own_decode_tokens))
        if report.num_total_blocks:
            self.cache.set_capacity(report.num_total_blocks)
        events = report.block_events
        if events is not msgspec.UNSET:
            if events.cursor < self.events_cursor:  # the worker restarted: its cache is empty
                self.cache.clear()
                self.tier_cache.clear()  # (a disk tier re-reports what it found at start)
            self.cache.apply_events(events.stored, events.evicted)
            tiers = events.tiers if events.tiers is not msgspec.UNSET else {}
            for tier, tier_events in tiers.items():
                if tier in SHARED_TIERS and self.shared_cache is not None:
                    self.has_shared_tier = True
                    self.shared_cache.apply_events(tier_events.stored, tier_events.evicted)
                else:
                    self.tier_cache.apply_events(tier_events.stored, tier_events.evicted)
            self.events_cursor = events.cursor

    def mark_failed(self, error: str, eject_seconds: float) -> None:
        """Passive ejection: out of every choice until an active check succeeds after a pause."""
        self.healthy = False
        self.last_error = error
        self.ejected_until = time.monotonic() + eject_seconds
        self.counters.failures += 1


class Ticket:
    """One request's load predictions on its endpoints; `close()` takes back whatever is left."""

    def __init__(self, prefill: Endpoint | None, decode: Endpoint, num_prompt_tokens: int,
                 num_uncached_prefill: int, num_uncached_decode: int) -> None:
        self.prefill, self.decode = prefill, decode
        self.num_prompt_tokens = num_prompt_tokens
        # Where the prompt is computed: the prefill hop's endpoint, else the decode endpoint.
        self._computing = prefill if prefill is not None else decode
        self._prefill_tokens = num_uncached_prefill if prefill is not None else num_uncached_decode
        self._decode_tokens = 0
        self.has_first_token = False
        self._computing.own_prefill_tokens += self._prefill_tokens
        self.decode.own_requests += 1
        self.closed = False

    def first_token(self) -> None:
        """The prompt is computed: its tokens move from prefill load to decode load."""
        if self.closed or self.has_first_token:
            return
        self.has_first_token = True
        self._computing.own_prefill_tokens -= self._prefill_tokens
        self._prefill_tokens = 0
        self._decode_tokens = self.num_prompt_tokens
        self.decode.own_decode_tokens += self._decode_tokens

    def move_prefill(self, prefill: Endpoint | None, num_uncached: int) -> None:
        """A retry moved the prompt's computation (None: the decode endpoint computes it)."""
        if self.closed or self.has_first_token:
            return
        self._computing.own_prefill_tokens -= self._prefill_tokens
        self.prefill = prefill
        if prefill is not None:
            prefill.counters.routed += 1
        self._computing = prefill if prefill is not None else self.decode
        self._prefill_tokens = num_uncached
        self._computing.own_prefill_tokens += num_uncached

    def move_decode(self, decode: Endpoint) -> None:
        """A retry or continuation moved the decode to another endpoint."""
        if self.closed:
            return
        if self._computing is self.decode:
            self._computing.own_prefill_tokens -= self._prefill_tokens
            self._computing = decode
            decode.own_prefill_tokens += self._prefill_tokens
        self.decode.own_decode_tokens -= self._decode_tokens
        self.decode.own_requests -= 1
        self.decode = decode
        decode.counters.routed += 1
        decode.own_decode_tokens += self._decode_tokens
        decode.own_requests += 1

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._computing.own_prefill_tokens -= self._prefill_tokens
        self.decode.own_decode_tokens -= self._decode_tokens
        self.decode.own_requests -= 1


class EndpointPool:
    """The router's endpoints by URL, in the order they were given (ties in the policy)."""

    def __init__(self, prefill: list[str], decode: list[str], both: list[str]) -> None:
        self.endpoints: dict[str, Endpoint] = {}
        self.shared_cache = CacheView(TIER_CACHE_BLOCKS)  # blocks in the workers' shared tier
        for role, urls in ((Role.PREFILL, prefill), (Role.DECODE, decode), (Role.BOTH, both)):
            for url in urls:
                url = url.rstrip("/")
                if url in self.endpoints:
                    raise ValueError(f"endpoint {url} is listed twice")
                self.endpoints[url] = Endpoint(url, role, shared_cache=self.shared_cache)
        if not any(e.role in (Role.DECODE, Role.BOTH) for e in self.endpoints.values()):
            raise ValueError("the router needs at least one --decode or --worker endpoint")

    def __getitem__(self, url: str) -> Endpoint:
        return self.endpoints[url]

    def __iter__(self):
        return iter(self.endpoints.values())

    def views(self, excluded: Iterable[str] = ()) -> list[EndpointView]:
        excluded = set(excluded)
        return [e.view(e.url in excluded) for e in self.endpoints.values()]

    def begin(self, decision: Decision, num_prompt_tokens: int, block_hashes: list[int]) -> Ticket:
        """Record the decision: predicted loads, predicted cache contents, routed counters."""
        prefill = self.endpoints[decision.prefill] if decision.prefill else None
        decode = self.endpoints[decision.decode]
        ticket = Ticket(prefill, decode, num_prompt_tokens,
                        num_prompt_tokens - decision.num_cached_prefill,
                        num_prompt_tokens - decision.num_cached_decode)
        for endpoint, cached in ((prefill, decision.num_cached_prefill),
                                 (decode, decision.num_cached_decode)):
            if endpoint is not None:
                endpoint.counters.routed += 1
                endpoint.counters.predicted_cached_tokens += cached
                endpoint.cache.touch(block_hashes)  # it will hold the whole prompt afterwards
        return ticket

    def is_ready(self) -> bool:
        return any(e.healthy and e.role in (Role.DECODE, Role.BOTH) for e in self.endpoints.values())


class SessionTable:
    """`x-session-affinity` key -> the (prefill, decode) pair that holds its KV; bounded LRU."""

    def __init__(self, capacity: int = 65536) -> None:
        self.capacity = capacity
        self._pairs: OrderedDict[str, tuple[str | None, str]] = OrderedDict()

    def get(self, key: str | None) -> tuple[str | None, str] | None:
        return self._pairs.get(key) if key else None

    def put(self, key: str | None, pair: tuple[str | None, str]) -> None:
        if not key:
            return
        self._pairs[key] = pair
        self._pairs.move_to_end(key)
        while len(self._pairs) > self.capacity:
            self._pairs.popitem(last=False)

    def __len__(self) -> int:
        return len(self._pairs)

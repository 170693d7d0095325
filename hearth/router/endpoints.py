"""The router's picture of its workers: health, estimated load and a view of each prefix cache.

Invariants:
  * every load prediction a request adds (`Ticket`) is taken back exactly once, on every path
    (finish, error, client gone), so estimates never drift upward;
  * an endpoint's load estimate is the router's own in-flight predictions plus the load its last
    report showed beyond them (requests from elsewhere), so a burst is seen before any report;
  * a cache view holds block hashes in LRU order: added when the router sends a prompt there
    (prediction), corrected by the worker's stored/evicted reports, bounded by its block count;
  * with discovery (hearth/router/discovery.py) endpoints come and go at run time: a draining
    endpoint takes no new request but finishes the ones it has; a removed endpoint leaves every
    choice at once and stays reachable by URL (`pool[url]`) only while requests the router sent
    there are still open, so a request in flight never loses its endpoint record.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterable

import msgspec

from hearth.config import Role
from hearth.router.policy import Decision, EndpointView
from hearth.api.load_report import LoadReport

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
    own_prefill_hops: int = 0  # prefill hops the router has open here (until the first token)
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
    draining: bool = False  # (discovery) finishing its requests, taking no new one
    name: str | None = None  # (discovery) the worker's name in the registry

    def __post_init__(self) -> None:
        self.role = Role.parse(self.role, f"endpoint {self.url}: role")

    @property
    def busy(self) -> bool:
        """The router has a request open here (a decode, or a prefill hop's prediction)."""
        return self.own_requests > 0 or self.own_prefill_hops > 0

    @property
    def prefill_tokens(self) -> int:
        return self.own_prefill_tokens + self.extra_prefill_tokens

    @property
    def decode_tokens(self) -> int:
        return self.own_decode_tokens + self.extra_decode_tokens

    def view(self, excluded: bool = False) -> EndpointView:
        return EndpointView(self.url, self.role, self.healthy and not excluded and not self.draining,
                            self.prefill_tokens,
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
        self._prefill_hop: Endpoint | None = None  # the endpoint of the open prefill hop
        self._open_prefill_hop(prefill)
        self.closed = False

    def _open_prefill_hop(self, prefill: Endpoint | None) -> None:
        self._close_prefill_hop()
        if prefill is not None:
            prefill.own_prefill_hops += 1
            self._prefill_hop = prefill

    def _close_prefill_hop(self) -> None:
        if self._prefill_hop is not None:
            self._prefill_hop.own_prefill_hops -= 1
            self._prefill_hop = None

    def first_token(self) -> None:
        """The prompt is computed: its tokens move from prefill load to decode load."""
        if self.closed or self.has_first_token:
            return
        self.has_first_token = True
        self._close_prefill_hop()
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
        self._open_prefill_hop(prefill)
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
        self._close_prefill_hop()
        self._computing.own_prefill_tokens -= self._prefill_tokens
        self.decode.own_decode_tokens -= self._decode_tokens
        self.decode.own_requests -= 1


class EndpointPool:
    """The router's endpoints by URL, in the order they were given (ties in the policy)."""

    def __init__(self, prefill: list[str], decode: list[str], both: list[str],
                 dynamic: bool = False) -> None:
        """`dynamic`: endpoints come from discovery (`reconcile`), so the pool may start empty."""
        self.endpoints: dict[str, Endpoint] = {}
        self.retired: dict[str, Endpoint] = {}  # removed, with requests of the router still open
        self.shared_cache = CacheView(TIER_CACHE_BLOCKS)  # blocks in the workers' shared tier
        for role, urls in ((Role.PREFILL, prefill), (Role.DECODE, decode), (Role.BOTH, both)):
            for url in urls:
                url = url.rstrip("/")
                if url in self.endpoints:
                    raise ValueError(f"endpoint {url} is listed twice")
                self.endpoints[url] = Endpoint(url, role, shared_cache=self.shared_cache)
        if not dynamic and not any(e.role in (Role.DECODE, Role.BOTH)
                                   for e in self.endpoints.values()):
            raise ValueError("the router needs at least one --decode or --worker endpoint")

    def __getitem__(self, url: str) -> Endpoint:
        endpoint = self.endpoints.get(url)
        return endpoint if endpoint is not None else self.retired[url]

    def get(self, url: str) -> Endpoint | None:
        """The endpoint, or None if discovery removed it and the router forgot it."""
        return self.endpoints.get(url) or self.retired.get(url)

    def reconcile(self, records) -> tuple[list[Endpoint], list[Endpoint]]:
        """Make the pool what discovery says: `records` (hearth/router/discovery.py
        WorkerRecord: name, role, url, draining) are every worker that exists now. Returns
        (added, removed). A worker whose URL is new starts unhealthy until its first /load."""
        wanted = {r.url.rstrip("/"): r for r in records}
        added, removed = [], []
        for url in [u for u in self.endpoints if u not in wanted]:
            endpoint = self.endpoints.pop(url)
            endpoint.healthy, endpoint.last_error = False, "removed by discovery"
            removed.append(endpoint)
            if endpoint.busy:
                self.retired[url] = endpoint
        for url, record in wanted.items():
            endpoint = self.endpoints.get(url)
            role = Role.parse(record.role, f"worker {record.name}: role")
            if endpoint is not None and endpoint.role is not role:  # a new worker on an old URL
                removed.append(self.endpoints.pop(url))
                endpoint = None
            if endpoint is None:
                endpoint = self.retired.pop(url, None)
                if endpoint is None or endpoint.role is not role:
                    endpoint = Endpoint(url, role, shared_cache=self.shared_cache)
                self.endpoints[url] = endpoint
                added.append(endpoint)
            endpoint.name, endpoint.draining = record.name, record.draining
        self.prune()
        return added, removed

    def prune(self) -> None:
        """Forget removed endpoints whose last request of this router has ended."""
        for url in [u for u, e in self.retired.items() if not e.busy]:
            del self.retired[url]

    def in_flight(self) -> dict[str, int]:
        """Requests this router has open on each endpoint (removed ones included)."""
        self.prune()
        return {e.url: e.own_requests + e.own_prefill_hops
                for e in [*self.endpoints.values(), *self.retired.values()]}

    def healthy_names(self) -> list[str]:
        """The discovered workers this router routes new requests to now (healthy, not
        draining), by registry name."""
        return sorted(e.name for e in self.endpoints.values()
                      if e.name and e.healthy and not e.draining)

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
        return any(e.healthy and not e.draining and e.role in (Role.DECODE, Role.BOTH)
                   for e in self.endpoints.values())


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

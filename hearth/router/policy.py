"""The routing policy: a pure function from one request and the endpoints' state to a decision.

`choose(request, endpoints, config)` reads only its arguments and returns a `Decision`; every
side effect (load predictions, the session table, metrics) happens in the caller. So the whole
policy is tested with fake endpoint views and exact expected choices.

Cost model (units: "prefill-token equivalents", i.e. how much work this request waits behind or
adds to; see docs/router.md):

    prefill on p     = prefill_weight * (p.prefill_tokens + uncached(request, p))
    decode on d      = decode_weight * (d.decode_tokens + request tokens) + prefill_weight * d.prefill_tokens
    transfer p -> d  = transfer_weight * uncached(request, d)       (only blocks d lacks cross the wire)
    PD pair (p, d)   = prefill on p + decode on d + transfer
    decode-only d    = decode on d + prefill_weight * uncached(request, d)   (d prefills the remainder)
    monolithic w     = prefill on w + decode on w                            (role "both")

Where an endpoint's KV tiers (its own disk, the shared store) hold blocks that continue its
cached prefix, those tokens are loaded, not computed: `uncached` excludes them and they cost
tier_weight each instead of prefill_weight (cheaper than recompute, dearer than the pool).

Prefill and decode terms are separable, so the best PD pair is the best p with the best d.
A decode endpoint that already holds at least `disagg_threshold` of the prompt (an agent's next
turn) is used decode-only: the prefill hop would move more bytes than the remainder costs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Container, Sequence

from hearth.config import Role

POLICIES = ("cost", "round_robin")


@dataclass(frozen=True)
class PolicyConfig:
    name: str = "cost"  # "cost" (token- and cache-aware) | "round_robin" (baseline)
    block_size: int = 16  # tokens per KV block: must equal the workers' --block-size
    prefill_weight: float = 1.0  # per prompt token still to compute (compute-bound, blocks TTFT)
    decode_weight: float = 0.1  # per context token of running decodes (memory-bound, shared)
    transfer_weight: float = 0.05  # per prompt token whose KV crosses the wire
    tier_weight: float = 0.05  # per prompt token loaded from a lower KV tier (disk, shared)
    disagg_threshold: float = 0.9  # skip the prefill hop when decode holds >= this prompt fraction
    min_disagg_tokens: int = 0  # prompts shorter than this never take the prefill hop
    affinity_max_cost_ratio: float = 2.0  # a session's pair is kept unless it costs more than
    affinity_slack: float = 2048.0  # ratio * best + slack (i.e. it is "overloaded")

    def __post_init__(self) -> None:
        if self.name not in POLICIES:
            raise ValueError(f"policy: {self.name!r} is not one of {POLICIES}")
        if self.block_size < 1:
            raise ValueError("policy block_size must be >= 1")
        if not 0.0 <= self.disagg_threshold <= 1.0:
            raise ValueError("disagg threshold must be within [0, 1]")


@dataclass(frozen=True)
class RequestView:
    num_prompt_tokens: int
    block_hashes: Sequence[int]  # chained hashes of the prompt's full blocks (engine/kv/block_hash.py)
    affinity: tuple[str | None, str] | None = None  # (prefill, decode) its session used last
    can_disaggregate: bool = True  # False (n > 1, echo, several prompts): no prefill hop
    sequence: int = 0  # arrival number, for round robin


@dataclass(frozen=True)
class EndpointView:
    name: str  # the endpoint's URL
    role: Role
    healthy: bool
    prefill_tokens: int = 0  # estimated uncached prompt tokens in flight
    decode_tokens: int = 0  # estimated context tokens of running decodes
    cached_hashes: Container[int] = frozenset()  # the router's view of its prefix cache
    tier_hashes: Container[int] = frozenset()  # blocks in its lower KV tiers (own + shared)


@dataclass(frozen=True)
class Decision:
    decode: str  # the endpoint that streams the answer (a decode or a monolithic worker)
    prefill: str | None  # the prefill hop's endpoint; None: `decode` computes the prompt itself
    reason: str  # "cost" | "affinity" | "cached" (conditional disaggregation) | "round_robin"
    num_cached_prefill: int  # predicted prompt tokens cached where the prompt is computed
    num_cached_decode: int  # predicted prompt tokens cached on the decode endpoint
    cost: float


class NoEndpointError(RuntimeError):
    """No healthy endpoint can serve the request."""


def num_cached_tokens(request: RequestView, cached_hashes: Container[int], block_size: int) -> int:
    """Tokens of the longest cached prefix; like the engine, never the prompt's last token."""
    num_blocks = 0
    for block_hash in request.block_hashes:
        if block_hash not in cached_hashes:
            break
        num_blocks += 1
    return min(num_blocks * block_size, max(0, request.num_prompt_tokens - 1))


def num_tier_tokens(request: RequestView, tier_hashes: Container[int], num_cached: int,
                    block_size: int) -> int:
    """Tokens after the cached prefix (`num_cached`) that the endpoint's lower tiers hold."""
    num_blocks = 0
    for block_hash in request.block_hashes[num_cached // block_size:]:
        if block_hash not in tier_hashes:
            break
        num_blocks += 1
    return min(num_blocks * block_size, max(0, request.num_prompt_tokens - 1 - num_cached))


def _prompt_cost(request: RequestView, e: EndpointView, config: PolicyConfig) -> tuple[int, float]:
    """(tokens not computed on `e`: pool hits + tier loads, the cost of its prompt there)."""
    cached = num_cached_tokens(request, e.cached_hashes, config.block_size)
    loaded = num_tier_tokens(request, e.tier_hashes, cached, config.block_size)
    computed = request.num_prompt_tokens - cached - loaded
    return cached + loaded, config.prefill_weight * computed + config.tier_weight * loaded


def choose(request: RequestView, endpoints: Sequence[EndpointView], config: PolicyConfig) -> Decision:
    healthy = [e for e in endpoints if e.healthy]
    if config.name == "round_robin":
        return _round_robin(request, healthy, config)
    options = _options(request, healthy, config)
    if not options:
        raise NoEndpointError("no healthy decode or monolithic endpoint")
    best = min(options, key=lambda d: d.cost)
    kept = _affinity_option(request, healthy, best, config)
    return kept if kept is not None else best


def choose_prefill(request: RequestView, endpoints: Sequence[EndpointView],
                   config: PolicyConfig) -> tuple[str, int] | None:
    """(name, cached tokens) of the cheapest healthy prefill endpoint: a prefill hop's retry."""
    costs = _prefill_costs(request, [e for e in endpoints if e.healthy], config)
    if not costs:
        return None
    name, (cached, _) = min(costs.items(), key=lambda item: item[1][1])
    return name, cached


def _options(request: RequestView, healthy: list[EndpointView], config: PolicyConfig,
             prefill_name: str | None = None) -> list[Decision]:
    """One candidate per decode/monolithic endpoint, in endpoint order (ties keep the first).
    PD candidates use the cheapest prefill endpoint, or `prefill_name` when given."""
    prefill = _prefill_costs(request, healthy, config)
    if prefill_name is not None:
        prefill = {prefill_name: prefill[prefill_name]} if prefill_name in prefill else {}
    best_prefill = min(prefill.items(), key=lambda item: item[1][1], default=None)
    options = []
    for e in healthy:
        if e.role == Role.BOTH:
            options.append(_monolithic(request, e, config))
        elif e.role == Role.DECODE:
            options.append(_decode_option(request, e, best_prefill, config))
    return options


def _prefill_costs(request: RequestView, healthy: list[EndpointView],
                   config: PolicyConfig) -> dict[str, tuple[int, float]]:
    """name -> (cached tokens, cost) of each healthy prefill endpoint, in endpoint order."""
    costs = {}
    for e in healthy:
        if e.role == Role.PREFILL:
            cached, prompt_cost = _prompt_cost(request, e, config)
            costs[e.name] = (cached, config.prefill_weight * e.prefill_tokens + prompt_cost)
    return costs


def _decode_cost(request: RequestView, e: EndpointView, config: PolicyConfig) -> float:
    return (config.decode_weight * (e.decode_tokens + request.num_prompt_tokens)
            + config.prefill_weight * e.prefill_tokens)


def _monolithic(request: RequestView, e: EndpointView, config: PolicyConfig) -> Decision:
    cached, prompt_cost = _prompt_cost(request, e, config)
    cost = _decode_cost(request, e, config) + prompt_cost
    return Decision(e.name, None, "cost", cached, cached, cost)


def _decode_option(request: RequestView, e: EndpointView,
                   best_prefill: tuple[str, tuple[int, float]] | None,
                   config: PolicyConfig) -> Decision:
    cached, prompt_cost = _prompt_cost(request, e, config)
    uncached = request.num_prompt_tokens - cached
    decode_cost = _decode_cost(request, e, config)
    local = Decision(e.name, None, "cached", cached, cached, decode_cost + prompt_cost)
    if best_prefill is None or not request.can_disaggregate:
        return local  # no prefill pool (or a request PD cannot split): decode prefills itself
    if request.num_prompt_tokens < config.min_disagg_tokens:
        return local
    if cached >= config.disagg_threshold * request.num_prompt_tokens:
        return local
    prefill_name, (prefill_cached, prefill_cost) = best_prefill
    cost = prefill_cost + decode_cost + config.transfer_weight * uncached
    return Decision(e.name, prefill_name, "cost", prefill_cached, cached, cost)


def _affinity_option(request: RequestView, healthy: list[EndpointView], best: Decision,
                     config: PolicyConfig) -> Decision | None:
    """The session's previous pair, while it is healthy and not overloaded (its cost stays
    within ratio * best + slack). A prefill endpoint that is gone is replaced by the cheapest."""
    if request.affinity is None:
        return None
    want_prefill, want_decode = request.affinity
    options = _options(request, healthy, config, want_prefill)
    if want_prefill is not None and not any(o.prefill == want_prefill for o in options):
        options = _options(request, healthy, config)
    for option in options:
        if option.decode != want_decode:
            continue
        if option.cost > config.affinity_max_cost_ratio * best.cost + config.affinity_slack:
            return None
        return Decision(option.decode, option.prefill, "affinity", option.num_cached_prefill,
                        option.num_cached_decode, option.cost)
    return None


def _round_robin(request: RequestView, healthy: list[EndpointView], config: PolicyConfig) -> Decision:
    """The cache-blind baseline: the request's arrival number picks each endpoint in turn."""
    decoders = [e for e in healthy if e.role in (Role.DECODE, Role.BOTH)]
    if not decoders:
        raise NoEndpointError("no healthy decode or monolithic endpoint")
    d = decoders[request.sequence % len(decoders)]
    prefill = [e for e in healthy if e.role == Role.PREFILL]
    p = None
    if d.role == Role.DECODE and prefill and request.can_disaggregate:
        p = prefill[request.sequence % len(prefill)]
    cached_d = num_cached_tokens(request, d.cached_hashes, config.block_size)
    cached_p = num_cached_tokens(request, p.cached_hashes, config.block_size) if p else cached_d
    return Decision(d.name, p.name if p else None, "round_robin", cached_p, cached_d, 0.0)

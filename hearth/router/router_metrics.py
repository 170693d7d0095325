"""The router's Prometheus metrics, prefix `hearth:router_`.

    hearth:router_requests_total                    counter   label path: pd | local (no prefill hop)
    hearth:router_decisions_total                   counter   label reason: cost|affinity|cached|round_robin
    hearth:router_retries_total                     counter   label hop: prefill | decode
    hearth:router_continuations_total               counter   decode failed mid-stream, remainder re-run
    hearth:router_stream_errors_total               counter   streams ended with an error event
    hearth:router_time_to_first_token_seconds       histogram as the client sees it
    hearth:router_endpoint_routed_total             counter   label endpoint, role
    hearth:router_endpoint_failures_total           counter   label endpoint, role
    hearth:router_endpoint_predicted_cached_tokens_total  counter  what the policy expected cached there
    hearth:router_endpoint_reported_cached_tokens_total   counter  what the endpoint's usage reported
    hearth:router_endpoint_prefill_tokens           gauge     estimated in-flight prefill tokens
    hearth:router_endpoint_decode_tokens            gauge     estimated active decode tokens
    hearth:router_endpoint_healthy                  gauge     1 healthy, 0 ejected or down
    hearth:router_endpoint_cached_blocks            gauge     size of the router's cache view

Endpoint series are refreshed from the pool at scrape time, so they cannot go stale. The
registry belongs to the app (no process-global state).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST

from hearth.router.endpoints import EndpointPool

PREFIX = "hearth:router_"
CONTENT_TYPE = CONTENT_TYPE_LATEST
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter(PREFIX + "requests", "Requests routed.", ["path"], registry=r)
        self.decisions = Counter(PREFIX + "decisions", "Policy decisions.", ["reason"], registry=r)
        self.retries = Counter(PREFIX + "retries", "Hops retried on another endpoint.", ["hop"],
                               registry=r)
        self.continuations = Counter(PREFIX + "continuations",
                                     "Decode failures continued on another endpoint.", registry=r)
        self.stream_errors = Counter(PREFIX + "stream_errors", "Streams ended with an error event.",
                                     registry=r)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token.",
                              buckets=TTFT_BUCKETS, registry=r)
        labels = ["endpoint", "role"]
        self._routed = Gauge(PREFIX + "endpoint_routed_total", "Requests routed to the endpoint.",
                             labels, registry=r)
        self._failures = Gauge(PREFIX + "endpoint_failures_total", "Failed hops on the endpoint.",
                               labels, registry=r)
        self._predicted = Gauge(PREFIX + "endpoint_predicted_cached_tokens_total",
                                "Prompt tokens the policy predicted cached.", labels, registry=r)
        self._reported = Gauge(PREFIX + "endpoint_reported_cached_tokens_total",
                               "Prompt tokens the endpoint reported cached.", labels, registry=r)
        self._prefill = Gauge(PREFIX + "endpoint_prefill_tokens", "Estimated in-flight prefill tokens.",
                              labels, registry=r)
        self._decode = Gauge(PREFIX + "endpoint_decode_tokens", "Estimated active decode tokens.",
                             labels, registry=r)
        self._healthy = Gauge(PREFIX + "endpoint_healthy", "1 when the endpoint takes requests.",
                              labels, registry=r)
        self._cached_blocks = Gauge(PREFIX + "endpoint_cached_blocks",
                                    "Blocks in the router's view of the endpoint's cache.", labels,
                                    registry=r)

    def render(self, pool: EndpointPool) -> bytes:
        # The *_total endpoint series are gauges set from the pool's counters: the pool owns the
        # numbers (the policy's bookkeeping needs them too), the registry only exposes them.
        for e in pool:
            labels = (e.url, e.role)
            self._routed.labels(*labels).set(e.counters.routed)
            self._failures.labels(*labels).set(e.counters.failures)
            self._predicted.labels(*labels).set(e.counters.predicted_cached_tokens)
            self._reported.labels(*labels).set(e.counters.reported_cached_tokens)
            self._prefill.labels(*labels).set(e.prefill_tokens)
            self._decode.labels(*labels).set(e.decode_tokens)
            self._healthy.labels(*labels).set(1 if e.healthy else 0)
            self._cached_blocks.labels(*labels).set(len(e.cache))
        return generate_latest(self.registry)

"""Prometheus metrics of one worker, prefix `hearth:`, named after vLLM's so dashboards port.

    hearth:time_to_first_token_seconds      histogram   arrival -> first token
    hearth:inter_token_latency_seconds      histogram   between consecutive output tokens
    hearth:e2e_request_latency_seconds      histogram   arrival -> finish
    hearth:request_queue_time_seconds       histogram   arrival -> first scheduled (engine-side)
    hearth:request_prompt_chunks_seconds    histogram   first scheduled -> start of the step that
                                                        samples its first token (earlier chunks)
    hearth:request_first_step_seconds       histogram   that step: its last prompt chunk, 1st token
    hearth:request_first_step_tokens        histogram   tokens that step computed (every request's)
    hearth:request_ttft_outside_engine_seconds  histogram  TTFT minus the engine's three parts:
                                                        HTTP, tokenizing, the step in flight when
                                                        it came, the way back
        (queue + prompt chunks + first step + outside engine = TTFT; observed at finish for
        requests that got a first token; docs/api.md, "Metrics")
    hearth:request_prompt_tokens            histogram   per finished request
    hearth:request_generation_tokens        histogram   per finished request
    hearth:prompt_tokens_total              counter
    hearth:generation_tokens_total          counter
    hearth:prefix_cache_queries_total       counter     prompt tokens looked up in the prefix cache
    hearth:prefix_cache_hits_total          counter     of those, found cached (= cached_tokens)
    hearth:request_success_total            counter     label finished_reason: stop|length|tool_calls|abort|error
    hearth:http_requests_rejected_total     counter     label reason: queue_full|body_too_large|auth
    hearth:num_requests_running             gauge       engine's running requests
    hearth:num_requests_waiting             gauge       engine's waiting requests
    hearth:kv_cache_usage_perc              gauge       fraction of KV blocks in use (0..1)
    hearth:num_prefill_tokens_inflight      gauge       uncached prompt tokens not yet computed
    hearth:num_decode_tokens_active         gauge       context tokens of running decodes
    hearth:num_free_kv_blocks               gauge
    hearth:step_prompt_tokens_while_decoding gauge      the step policy's prompt budget beside decodes
    hearth:step_decode_seconds              gauge       median recent pure-decode step (measured)
    hearth:step_prompt_token_seconds        gauge       median measured cost of one prompt token
    hearth:kv_tier_<counter>                gauge       label tier: host|disk|shared (docs/kv_tiers.md):
        hit_blocks, read_bytes, stored_blocks, written_bytes, evicted_blocks, write_errors,
        corrupt_blocks (counters since start), blocks, bytes (held now)
    hearth:kv_offload_queue_depth           gauge       evicted blocks staged, not yet written
    hearth:kv_offload_<counter>             gauge       dropped_blocks, skipped_blocks (already
        stored), offloaded_blocks, loads, load_failures, load_timeouts, loaded_tokens,
        load_seconds (sum: load latency = load_seconds / loads)

The same engine gauges also go out under the vLLM names of the Gateway API Inference Extension's
model server protocol, the names its endpoint picker (and llm-d's, KServe's) scrapes by default
(`--total-queued-requests-metric`, `--total-running-requests-metric`,
`--kv-cache-usage-percentage-metric`, `--lora-info-metric`, `--cache-info-metric`), so a picker
routes to hearth workers with no flags set (docs/deploy.md, "Kubernetes"):

    vllm:num_requests_waiting               gauge       = hearth:num_requests_waiting
    vllm:num_requests_running               gauge       = hearth:num_requests_running
    vllm:kv_cache_usage_perc                gauge       = hearth:kv_cache_usage_perc
    vllm:gpu_cache_usage_perc               gauge       the same, under vLLM's name before the
                                                        rename (older pickers read only that)
    vllm:cache_config_info                  gauge = 1   labels block_size, num_gpu_blocks (tokens per
                                                        KV block, blocks in the pool)
    vllm:lora_requests_info                 gauge       labels max_lora="0", running_lora_adapters="",
                                                        waiting_lora_adapters=""; value: when last set
                                                        (unix seconds). hearth serves no LoRA: the
                                                        protocol asks this only of LoRA servers, but
                                                        the picker's default config reads it and logs
                                                        "extract failed" on every scrape without it;
                                                        with max_lora 0 its LoRA scorer gives every
                                                        hearth worker the same score.

Every series carries `model_name`, except the two `_info` series, whose labels are vLLM's. The
registry belongs to the app (no process-global state).
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST

from hearth.engine.request import RequestOutput
from hearth.engine.stats import EngineStats

PREFIX = "hearth:"
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                   5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)
CONTENT_TYPE = CONTENT_TYPE_LATEST
# KV-tier counters of EngineStats.kv_tiers -> (metric name, help)
TIER_COUNTERS = {
    "hits": ("hit_blocks", "Blocks loaded back from this tier."),
    "bytes_read": ("read_bytes", "Bytes loaded back from this tier."),
    "stored": ("stored_blocks", "Blocks written to this tier."),
    "bytes_written": ("written_bytes", "Bytes written to this tier."),
    "evicted": ("evicted_blocks", "Blocks this tier dropped (its size cap)."),
    "write_errors": ("write_errors", "Writes that failed (disk full, directory gone)."),
    "corrupt": ("corrupt_blocks", "Records that failed their checks (never loaded)."),
    "num_blocks": ("blocks", "Blocks held now."),
    "num_bytes": ("bytes", "Bytes held now."),
}
OFFLOAD_COUNTERS = {
    "queue_depth": ("queue_depth", "Evicted blocks staged, not yet written."),
    "offloaded": ("offloaded_blocks", "Evicted blocks handed to the writer."),
    "offload_skipped": ("skipped_blocks", "Evicted blocks a tier already held."),
    "offload_dropped": ("dropped_blocks", "Evicted blocks dropped: staging full."),
    "loads": ("loads", "Loads from the tiers (one per admitted request)."),
    "load_failures": ("load_failures", "Loads that stopped early (the rest recomputed)."),
    "load_timeouts": ("load_timeouts", "Loads cancelled at their deadline."),
    "load_tokens": ("loaded_tokens", "Prompt tokens loaded instead of computed."),
    "load_seconds": ("load_seconds", "Seconds spent in loads (sum)."),
}
# the model server protocol's gauges: vLLM name -> (EngineStats field, help)
MSP_GAUGES = {
    "vllm:num_requests_waiting": ("num_waiting", "Requests waiting in the engine."),
    "vllm:num_requests_running": ("num_running", "Requests running in the engine."),
    "vllm:kv_cache_usage_perc": ("kv_usage", "Fraction of KV-cache blocks in use (0..1)."),
    "vllm:gpu_cache_usage_perc": ("kv_usage", "Fraction of KV-cache blocks in use (0..1); "
                                  "vLLM's older name of vllm:kv_cache_usage_perc."),
}


class ServerMetrics:
    def __init__(self, model_name: str, *, block_size: int, num_blocks: int) -> None:
        """`block_size` (tokens per KV block) and `num_blocks` (the pool) are the engine's, for
        vllm:cache_config_info."""
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=self.registry)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, labels + list(extra), registry=self.registry)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=self.registry)

        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Inter-token latency.", LATENCY_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "End-to-end request latency.", LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Time waiting before first scheduled.",
                                    LATENCY_BUCKETS)
        self.prompt_chunks_time = histogram(
            "request_prompt_chunks_seconds", "First scheduled -> start of the step that samples "
            "the first token (the earlier prompt chunks).", LATENCY_BUCKETS)
        self.first_step_time = histogram(
            "request_first_step_seconds", "The step that computes the last prompt chunk and "
            "samples the first token.", LATENCY_BUCKETS)
        self.first_step_tokens = histogram(
            "request_first_step_tokens", "Tokens computed in a request's first-token step (every "
            "request's).", TOKEN_BUCKETS)
        self.outside_engine_time = histogram(
            "request_ttft_outside_engine_seconds", "TTFT minus queue, prompt chunks and first "
            "step: HTTP, tokenizing, the step in flight on arrival, the way back.", LATENCY_BUCKETS)
        self.prompt_tokens_hist = histogram("request_prompt_tokens", "Prompt tokens per request.",
                                            TOKEN_BUCKETS)
        self.generation_tokens_hist = histogram("request_generation_tokens",
                                                "Generated tokens per request.", TOKEN_BUCKETS)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.finished = counter("request_success", "Finished requests by reason.", ("finished_reason",))
        self.rejected = counter("http_requests_rejected", "Requests refused before the engine.", ("reason",))
        self.running = gauge("num_requests_running", "Requests running in the engine.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting in the engine.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use.")
        self.prefill_inflight = gauge("num_prefill_tokens_inflight", "Uncached prompt tokens not yet computed.")
        self.decode_active = gauge("num_decode_tokens_active", "Context tokens of running decodes.")
        self.free_blocks = gauge("num_free_kv_blocks", "Free KV-cache blocks.")
        self.policy_gauges = {
            "prompt_tokens_while_decoding": gauge(
                "step_prompt_tokens_while_decoding",
                "Prompt tokens a step may carry while any request decodes (the step policy)."),
            "decode_step_seconds": gauge("step_decode_seconds",
                                         "Median of recent pure-decode step times."),
            "prompt_token_seconds": gauge("step_prompt_token_seconds",
                                          "Median measured cost of one prompt token."),
        }
        self.tier_gauges = {
            key: Gauge(PREFIX + "kv_tier_" + name, doc, labels + ["tier"], registry=self.registry)
            for key, (name, doc) in TIER_COUNTERS.items()}
        # speculative decoding, under vLLM's names (counters fed from the engine's totals)
        self.spec = {
            "num_spec_drafts": counter("spec_decode_num_drafts", "Request-steps that verified drafts."),
            "num_spec_draft_tokens": counter("spec_decode_num_draft_tokens", "Draft tokens verified."),
            "num_spec_accepted_tokens": counter("spec_decode_num_accepted_tokens",
                                                "Draft tokens accepted."),
        }
        self.spec_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                    "Draft tokens accepted at each position.", ("position",))
        self._spec_seen: dict[str, int] = {}
        # Mixture-of-Experts: tokens routed to each expert of each MoE layer (fed from totals)
        self.expert_tokens = counter("moe_expert_tokens", "Tokens routed to each expert, per "
                                     "MoE layer (a token counts once per expert it picked).",
                                     ("layer", "expert"))
        # per MoE layer: each expert's total already counted, and its labelled counter
        self._expert_seen: dict[int, list[int]] = {}
        self._expert_children: dict[int, dict[int, object]] = {}
        self.offload_gauges = {
            key: gauge("kv_offload_" + name, doc) for key, (name, doc) in OFFLOAD_COUNTERS.items()}
        self.msp_gauges = {name: Gauge(name, doc, labels, registry=self.registry)
                           for name, (_, doc) in MSP_GAUGES.items()}
        Gauge("vllm:cache_config_info", "KV-cache configuration (labels).",
              ["block_size", "num_gpu_blocks"], registry=self.registry,
              ).labels(block_size=str(block_size), num_gpu_blocks=str(num_blocks)).set(1)
        self.lora_info = Gauge(
            "vllm:lora_requests_info", "LoRA adapters running and waiting (hearth serves none).",
            ["max_lora", "running_lora_adapters", "waiting_lora_adapters"], registry=self.registry,
        ).labels(max_lora="0", running_lora_adapters="", waiting_lora_adapters="")

    def _m(self, metric, **labels):
        return metric.labels(model_name=self.model_name, **labels)

    def observe_first_token(self, seconds: float, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        self._m(self.ttft).observe(seconds)
        self._m(self.prompt_tokens).inc(num_prompt_tokens)
        self._m(self.cache_queries).inc(num_prompt_tokens)
        self._m(self.cache_hits).inc(num_cached_tokens)

    def observe_tokens(self, num_tokens: int, seconds_since_last: float | None) -> None:
        self._m(self.generation_tokens).inc(num_tokens)
        if seconds_since_last is not None and num_tokens:
            per_token = seconds_since_last / num_tokens
            for _ in range(num_tokens):
                self._m(self.itl).observe(per_token)

    def observe_finish(self, reason: str, e2e_seconds: float, num_prompt_tokens: int,
                       num_output_tokens: int, queue_seconds: float | None) -> None:
        self._m(self.finished, finished_reason=reason).inc()
        self._m(self.e2e).observe(e2e_seconds)
        self._m(self.prompt_tokens_hist).observe(num_prompt_tokens)
        self._m(self.generation_tokens_hist).observe(num_output_tokens)
        if queue_seconds is not None:
            self._m(self.queue_time).observe(queue_seconds)

    def observe_ttft_breakdown(self, ttft_seconds: float, output: RequestOutput) -> None:
        """Where a finished request's TTFT went (nothing if the engine reports no breakdown)."""
        if output.first_step_seconds is None or output.queue_seconds is None:
            return
        engine = output.queue_seconds + output.prompt_chunks_seconds + output.first_step_seconds
        self._m(self.prompt_chunks_time).observe(output.prompt_chunks_seconds)
        self._m(self.first_step_time).observe(output.first_step_seconds)
        self._m(self.first_step_tokens).observe(output.first_step_tokens)
        self._m(self.outside_engine_time).observe(max(0.0, ttft_seconds - engine))

    def observe_rejected(self, reason: str) -> None:
        self._m(self.rejected, reason=reason).inc()

    def set_engine_stats(self, stats: EngineStats) -> None:
        self._m(self.running).set(stats.num_running)
        self._m(self.waiting).set(stats.num_waiting)
        self._m(self.kv_usage).set(stats.kv_usage)
        self._m(self.prefill_inflight).set(stats.num_prefill_tokens_inflight)
        self._m(self.decode_active).set(stats.num_decode_tokens_active)
        self._m(self.free_blocks).set(stats.num_free_blocks)
        for field, metric in self.policy_gauges.items():
            self._m(metric).set(getattr(stats, field))
        for name, (field, _) in MSP_GAUGES.items():
            self._m(self.msp_gauges[name]).set(getattr(stats, field))
        self.lora_info.set(time.time())
        totals = {k: getattr(stats, k) for k in self.spec}
        totals.update({f"pos{i}": n for i, n in enumerate(stats.spec_accepted_per_position)})
        for key, total in totals.items():
            delta = total - self._spec_seen.get(key, 0)
            if delta > 0:
                metric = (self._m(self.spec[key]) if key in self.spec
                          else self._m(self.spec_per_pos, position=key[3:]))
                metric.inc(delta)
                self._spec_seen[key] = total
        for layer, counts in stats.moe_expert_tokens.items():
            seen = self._expert_seen.setdefault(layer, [])
            seen.extend([0] * (len(counts) - len(seen)))
            children = self._expert_children.setdefault(layer, {})
            for expert, total in enumerate(counts):
                delta = total - seen[expert]
                if delta > 0:
                    child = children.get(expert)
                    if child is None:  # prometheus' labels() lookup: ~3 us, once per series
                        child = children[expert] = self._m(
                            self.expert_tokens, layer=str(layer), expert=str(expert))
                    child.inc(delta)
                    seen[expert] = total
        for tier, counters in stats.kv_tiers.items():
            names = OFFLOAD_COUNTERS if tier == "offload" else TIER_COUNTERS
            for key, value in counters.items():
                if key not in names:
                    continue
                if tier == "offload":
                    self._m(self.offload_gauges[key]).set(value)
                else:
                    self._m(self.tier_gauges[key], tier=tier).set(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)

"""EngineStats: the engine's load and counters, one type from `LLMEngine.stats()` to the router.

The engine builds it; the engine core sends it to the server as is (msgpack, inside
`StepOutputs`, `LoadReply`, `EngineReady`); the server's `/load` body is it plus a few fields
(hearth/api/load_report.py). So a field added or renamed here reaches every reader or
fails to type-check, instead of vanishing on the way. Every field has a default: a server
holds an all-zero one until the engine's first report.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec


@dataclass
class EngineCounters:
    """The engine's own counters since start (EngineStats carries them out)."""

    prompt: int = 0  # prompt tokens of requests that got their first token
    cached: int = 0  # of those, served from the prefix cache (or a transfer)
    generation: int = 0  # output tokens, forced ones included
    forced: int = 0  # appended by jump-forward, without a decode step
    preemptions: int = 0
    computed_prompt: int = 0  # prompt tokens this engine computed


class EngineStats(msgspec.Struct, kw_only=True):
    num_running: int = 0
    num_waiting: int = 0  # includes guided requests whose grammar is compiling
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    num_prefill_tokens_inflight: int = 0  # uncached prompt tokens not yet computed
    num_decode_tokens_active: int = 0  # context tokens of running decodes
    num_prompt_tokens: int = 0  # counters since start
    num_cached_tokens: int = 0
    num_generation_tokens: int = 0
    num_forced_tokens: int = 0  # of those, appended by jump-forward without a decode step
    num_preemptions: int = 0
    kv_usage: float = 0.0  # fraction of KV blocks in use
    # prefill/decode disaggregation (zero on a `both` worker)
    num_waiting_for_kv: int = 0  # decode side: requests whose prompt KV is being pulled
    num_leases_active: int = 0  # prefill side: exported KV held for a decode worker
    num_computed_prompt_tokens: int = 0  # prompt tokens run through the model (counter)
    num_transferred_tokens: int = 0  # decode side: prompt tokens received instead (counter)
    num_transferred_blocks: int = 0
    num_transferred_bytes: int = 0
    num_kv_transfer_failures: int = 0  # imports that fell back to local recompute
    # structured output
    num_waiting_for_grammar: int = 0  # guided requests whose grammar is compiling (in num_waiting)
    num_grammars_compiling: int = 0  # compiles queued or running (timed-out ones until they end)
    # Mixture-of-Experts: tokens routed to each expert since start, per MoE layer (layer index
    # -> [num_experts] counts); empty for a dense model, with tensor/pipeline ranks, and in the
    # step outputs between two reports (core_process.py: at most once a second, and whenever a
    # request ends): empty means no news, not zero
    moe_expert_tokens: dict[int, list[int]] = {}
    # speculative decoding (counters since start; zero with --speculative-method off)
    num_spec_drafts: int = 0  # request-steps that verified draft tokens
    num_spec_draft_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = []  # [i]: drafts accepted at position i
    # KV tiers below the pool: tier name ("host", "disk", "shared") -> counters, and
    # "offload" -> the writer queue and loads (docs/kv_tiers.md); empty without tiers
    kv_tiers: dict[str, dict[str, float]] = {}
    # the step policy (hearth/engine/step_policy.py): the prompt tokens a step may carry beside
    # decodes now, and the measured costs it follows (medians of recent steps; 0: none yet)
    prompt_tokens_while_decoding: int = 0
    decode_step_seconds: float = 0.0
    prompt_token_seconds: float = 0.0

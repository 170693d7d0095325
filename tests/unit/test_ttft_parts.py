"""Where a TTFT goes: a worker's histograms of the engine's breakdown, and the peers benchmark
reading their means back off /metrics text."""

import math

from hearth.bench.peer_report import (format_report, histogram_totals, quantile,
                                      ttft_part_means)
from hearth.engine.request import RequestOutput
from hearth.server.worker_metrics import ServerMetrics


def finished(queue, chunks, first_step, tokens) -> RequestOutput:
    return RequestOutput("r", [], "", True, "stop", queue_seconds=queue,
                         prompt_chunks_seconds=chunks, first_step_seconds=first_step,
                         first_step_tokens=tokens)


def test_breakdown_histograms_read_back_as_per_request_means():
    metrics = ServerMetrics("m", block_size=16, num_blocks=8)
    before = histogram_totals(metrics.render().decode())
    for out, ttft in ((finished(0.5, 0.0, 0.25, 100), 1.0), (finished(0.25, 1.0, 0.25, 300), 2.0)):
        metrics.observe_finish("stop", ttft + 1, 10, 4, out.queue_seconds)
        metrics.observe_ttft_breakdown(ttft, out)
    # an aborted request with no first token: no breakdown, no samples
    metrics.observe_ttft_breakdown(3.0, RequestOutput("x", [], "", True, "abort", queue_seconds=1.0))
    after = histogram_totals(metrics.render().decode())
    means = ttft_part_means(before, after)
    assert means == {"queue_s": 0.75 / 2, "prompt_chunks_s": 0.5, "first_step_s": 0.25,
                     "outside_engine_s": (0.25 + 0.5) / 2, "first_step_tokens": 200.0}
    assert ttft_part_means(after, after) == {}  # no request finished in between
    assert histogram_totals("vllm:time_to_first_token_seconds_sum 3.0\n") == {}  # a peer


def test_quantile_and_the_agent_figures_later_turn_rows():
    assert math.isnan(quantile([], 0.9))
    assert quantile([3.0, 1.0, 2.0], 0.5) == 2.0 and quantile(list(range(10)), 0.9) == 9
    run = {"value": 40.0, "hit_ratio": 0.86, "hit_ceiling": 0.9, "output_tok_s": 20.0,
           "num_requests": 64, "later_ttft_p50_s": 1.5, "later_ttft_p90_s": 3.0,
           "itl_p90_ms": 150.0, "queue_s": 0.1, "prompt_chunks_s": 0.2, "first_step_s": 0.3,
           "outside_engine_s": 0.05, "first_step_tokens": 900.0}
    peer = {"value": 44.0, "hit_ratio": 0.84, "hit_ceiling": 0.9, "output_tok_s": 18.0,
            "num_requests": 64, "later_ttft_p50_s": 1.0, "later_ttft_p90_s": 2.0,
            "itl_p90_ms": 50.0}
    text = format_report({"servers": {"hearth": {"figures": {"agent": [run]}},
                                       "vllm": {"figures": {"agent": [peer]}}}})
    assert "| agent replay, later-turn TTFT p50 | s | 1 | 1.5 | 1.5 | |" in text
    assert "| agent replay, later-turn TTFT p50 | lower | 1.5x |" in text
    assert "| agent replay, ITL p90 | lower | 3x |" in text
    assert ("TTFT parts (mean, all turns): queue 100 ms, prompt chunks 200 ms, first step 300 ms, "
            "outside engine 50 ms, first step 900 tokens") in text


def test_the_step_policy_gauges_carry_the_engines_figures():
    from hearth.engine.stats import EngineStats

    metrics = ServerMetrics("m", block_size=16, num_blocks=8)
    metrics.set_engine_stats(EngineStats(prompt_tokens_while_decoding=192,
                                         decode_step_seconds=0.02, prompt_token_seconds=0.0005))
    text = metrics.render().decode()
    assert 'hearth:step_prompt_tokens_while_decoding{model_name="m"} 192.0' in text
    assert 'hearth:step_decode_seconds{model_name="m"} 0.02' in text
    assert 'hearth:step_prompt_token_seconds{model_name="m"} 0.0005' in text

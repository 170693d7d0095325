"""Agent-trace replay: shared text exactly where the trace shares blocks; the infinite-cache ceiling."""

from hearth.bench.agent_replay import ReplayConfig, block_text, hit_ceiling, session_requests

CFG = ReplayConfig(tokens_per_block=3, output_scale=0.5, min_output_tokens=2, max_output_tokens=10)


def make_trace(trace_id: str, blocks: list[list[int]], harness_tokens: int = 128, out: int = 8) -> dict:
    return {"id": trace_id, "system_tokens": harness_tokens, "tool_tokens": 0,
            "requests": [{"hash_ids": ids, "out": out, "think_time": 1.0} for ids in blocks]}


def test_harness_blocks_are_common_to_sessions_and_the_rest_is_private():
    a = session_requests(make_trace("a", [[1, 2, 3]]), CFG)[0]
    b = session_requests(make_trace("b", [[1, 2, 3]]), CFG)[0]
    assert a.block_keys == (("harness", 0), ("harness", 1), ("a", 3))
    assert b.block_keys == (("harness", 0), ("harness", 1), ("b", 3))
    assert a.prompt.split()[:6] == b.prompt.split()[:6]
    assert a.prompt.split()[6:] != b.prompt.split()[6:]
    assert len(a.prompt.split()) == 9


def test_a_rewritten_harness_block_stays_private():
    first, second = session_requests(make_trace("a", [[1, 2, 3], [1, 9, 3]]), CFG)
    assert second.block_keys == (("harness", 0), ("a", 9), ("a", 3))


def test_outputs_scale_and_clamp_and_salt_changes_every_block():
    requests = session_requests(make_trace("a", [[1], [1]], out=100), CFG)
    assert [r.max_tokens for r in requests] == [10, 10]
    assert session_requests(make_trace("a", [[1]], out=1), CFG)[0].max_tokens == 2
    assert block_text(("", "a", 1), 4) == block_text(("", "a", 1), 4)
    assert block_text(("x", "a", 1), 4) != block_text(("", "a", 1), 4)


def test_hit_ceiling_counts_leading_blocks_seen_before_in_send_order():
    a1, a2 = session_requests(make_trace("a", [[1, 2, 3], [1, 2, 3, 4, 5]]), CFG)
    (b1,) = session_requests(make_trace("b", [[1, 2, 7]]), CFG)
    # a1: 0 of 3; b1: the 2 harness blocks of 3; a2: 3 of 5 (a1's blocks, then new ones)
    assert hit_ceiling([a1, b1, a2]) == (0 + 2 + 3) / (3 + 3 + 5)
    # a2 sent before a1: it pays for its blocks and a1 finds all three
    assert hit_ceiling([a2, a1, b1]) == (0 + 3 + 2) / (5 + 3 + 3)
    assert hit_ceiling([]) == 0.0

"""How models and steps are cut across ranks: shape checks, stage ranges, micro-batches."""

import pytest

from hearth.engine.parallel.distributed import RankLayout
from hearth.engine.parallel.layout import check_parallel_shape, kv_bytes_per_block_per_rank, split_layers
from hearth.engine.parallel.messages import SampleRow, StepCommand
from hearth.engine.parallel.stage import micro_batches
from hearth.engine.step import split_micro_batches
from hearth.models.arch import ModelArch


def make_arch(num_heads=9, num_kv_heads=3, num_layers=30, intermediate=1536, **kw) -> ModelArch:
    """SmolLM2-135M's shape by default."""
    return ModelArch("llama", vocab_size=49152, hidden_size=576, intermediate_size=intermediate,
                     num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads,
                     head_dim=64, max_position_embeddings=8192, **kw)


def test_tp_must_divide_heads_and_the_error_lists_valid_sizes():
    with pytest.raises(ValueError, match=r"tensor parallel size 2 does not divide the model's "
                                         r"num_heads=9, num_kv_heads=3; valid sizes: 1, 3$"):
        check_parallel_shape(make_arch(), 2, 1)
    check_parallel_shape(make_arch(), 3, 1)
    with pytest.raises(ValueError, match="intermediate_size=1536"):
        check_parallel_shape(make_arch(), 9, 1)
    check_parallel_shape(make_arch(intermediate=1152), 9, 1)  # 3 KV heads, each on 3 ranks


def test_replicated_kv_heads_must_line_up_with_query_heads():
    check_parallel_shape(make_arch(num_heads=8, num_kv_heads=2, intermediate=64), 4, 1)
    with pytest.raises(ValueError, match="num_kv_heads=4"):
        check_parallel_shape(make_arch(num_heads=12, num_kv_heads=4, intermediate=60), 6, 1)


def test_tp_must_divide_intermediate_size():
    with pytest.raises(ValueError, match="intermediate_size=100"):
        check_parallel_shape(make_arch(num_heads=8, num_kv_heads=8, intermediate=100), 8, 1)


def test_pp_larger_than_layer_count():
    with pytest.raises(ValueError, match="pipeline parallel size 31 is larger than the model's "
                                         "30 layers"):
        check_parallel_shape(make_arch(), 1, 31)
    check_parallel_shape(make_arch(), 1, 30)
    with pytest.raises(ValueError, match=">= 1"):
        check_parallel_shape(make_arch(), 0, 1)


def test_split_layers_is_contiguous_and_balanced_with_extras_first():
    assert split_layers(30, 1) == [(0, 30)]
    assert split_layers(30, 2) == [(0, 15), (15, 30)]
    assert split_layers(30, 4) == [(0, 8), (8, 16), (16, 23), (23, 30)]
    assert split_layers(4, 3) == [(0, 2), (2, 3), (3, 4)]
    assert split_layers(3, 3) == [(0, 1), (1, 2), (2, 3)]


def test_kv_block_bytes_follow_the_busiest_rank():
    arch = make_arch()
    one = 2 * 30 * 16 * 3 * 64 * 4
    assert kv_bytes_per_block_per_rank(arch, 1, 1, 16, 4) == one
    assert kv_bytes_per_block_per_rank(arch, 3, 1, 16, 4) == one // 3
    assert kv_bytes_per_block_per_rank(arch, 1, 4, 16, 4) == 2 * 8 * 16 * 3 * 64 * 4
    assert kv_bytes_per_block_per_rank(arch, 9, 1, 16, 4) == one // 3  # replicated: 1 head each


@pytest.mark.parametrize("tokens, m, expected", [
    ([1, 1, 1, 1], 2, [2, 2]),
    ([1, 1, 1, 1], 4, [1, 1, 1, 1]),
    ([1, 1, 1], 4, [1, 1, 1]),  # never more groups than requests
    ([100, 1, 1, 1], 2, [1, 3]),  # a long prefill fills its group alone
    ([1, 1, 1, 100], 2, [3, 1]),
    ([5, 5, 5, 5, 5, 5], 3, [2, 2, 2]),
    ([7], 4, [1]),
    ([3, 3, 3], 1, [3]),
    ([50, 50, 1, 1], 4, [1, 1, 1, 1]),  # later requests still get groups of their own
])
def test_split_micro_batches(tokens, m, expected):
    assert split_micro_batches(tokens, m) == expected


def test_split_micro_batches_invariants():
    for n in range(1, 12):
        for m in range(1, 6):
            tokens = [(i * 37) % 11 + 1 for i in range(n)]
            sizes = split_micro_batches(tokens, m)
            assert sum(sizes) == n and all(sizes) and len(sizes) == min(n, m)


def make_row(index: int) -> SampleRow:
    return SampleRow(index, 0.0, 1.0, 0, 0.0, 0.0, 0.0, 1.0, None, None)


def test_micro_batches_map_sample_rows_to_their_last_token():
    # Requests of 3, 1, 4, 2 tokens; request 0 is a prefill chunk that does not sample.
    cmd = StepCommand(input_ids=list(range(10)), query_lens=[3, 1, 4, 2],
                      context_lens=[3, 9, 4, 20], slots=[0, 1, 2, 3], num_known_blocks=[0] * 4,
                      new_block_ids=[[0], [1], [2], [3, 4]], table_checksum=0,
                      micro_batch_sizes=[2, 2], samples=[make_row(1), make_row(2), make_row(3)])
    mb0, mb1 = micro_batches(cmd, cmd.samples)
    assert (mb0.first, mb0.num_requests, mb0.token_start, mb0.num_tokens) == (0, 2, 0, 4)
    assert [s.index for s in mb0.samples] == [1] and mb0.sample_rows == [3]
    assert (mb1.first, mb1.num_requests, mb1.token_start, mb1.num_tokens) == (2, 2, 4, 6)
    assert [s.index for s in mb1.samples] == [2, 3] and mb1.sample_rows == [3, 5]


def test_rank_layout():
    layout = RankLayout(tensor_parallel_size=2, pipeline_parallel_size=3)
    assert layout.world_size == 6
    assert [(layout.stage(r), layout.tp_rank(r)) for r in range(6)] == [
        (0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert layout.sampler_rank == 4 and layout.rank_of(1, 1) == 3
    assert layout.describe(3) == "rank 3 (stage 1, tp 1)"

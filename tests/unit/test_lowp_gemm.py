"""The prepacked bf16 weight (hearth/ops/lowp_gemm.py) gives F.linear's numbers on the plain
bf16 weight at every row count, the split row range included, and replaces the plain copy."""

import pytest
import torch
import torch.nn.functional as F

from hearth.ops.lowp_gemm import SPLIT_ROWS, SPLIT_UNTIL, LowpWeight, packing_works


@pytest.mark.parametrize("rows", [1, 9, 32, SPLIT_ROWS, SPLIT_ROWS + 1, 2 * SPLIT_ROWS + 3,
                                  SPLIT_UNTIL, 1030])
def test_packed_weight_equals_f_linear(rows):
    torch.manual_seed(rows)
    weight = torch.randn(200, 96)
    lowp = LowpWeight(weight, torch.bfloat16)
    x = torch.randn(rows, 96).bfloat16()
    out = lowp(x)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 200)
    assert torch.equal(out, F.linear(x, weight.bfloat16()))
    assert lowp(x[::2]).shape == (len(range(0, rows, 2)), 200)  # a strided view is fine too
    x3 = x[:rows - rows % 3].view(-1, 3, 96)  # leading dims beyond rows, as F.linear takes
    assert torch.equal(lowp(x3), F.linear(x3, weight.bfloat16()))


def test_packing_replaces_the_plain_copy_where_it_works():
    lowp = LowpWeight(torch.randn(64, 32), torch.bfloat16)
    if packing_works(torch.bfloat16):
        assert lowp.packed is not None and lowp.plain is None
    else:
        assert lowp.packed is None and lowp.plain.dtype == torch.bfloat16


def test_other_dtypes_stay_plain():
    weight = torch.randn(64, 32)
    lowp = LowpWeight(weight, torch.float16)  # only bf16 was measured packed
    x = torch.randn(5, 32).half()
    assert lowp.packed is None and torch.equal(lowp(x), F.linear(x, weight.half()))

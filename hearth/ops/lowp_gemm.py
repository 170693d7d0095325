"""bf16 GEMMs against weights prepacked once into oneDNN's blocked layout.

`F.linear` on a plain bf16 weight lets oneDNN reorder (repack) the whole weight on every call
before its AMX / AVX512-BF16 kernel runs: at decode-batch sizes, where a step reads each weight
once, that reorder is most of the cost. Packing once at load (`torch.ops.mkldnn.
_reorder_linear_weight`, the call inductor's CPU weight freezing makes) and multiplying with
`_linear_pointwise` gives the same numbers (the same kernel, bit-equal in the probe below) for
less time. Measured on a 2-core AMX Xeon (2026-12-06), packed over plain time for the default
model's shapes (out x in), by rows:

    rows          32    64   128   256   384   512   768  1024  2048
    576 x 576    0.63  0.84  0.85  0.78  1.54  1.51  0.95  0.48  0.90
    3072 x 576   0.59  0.62  0.62  0.69  0.79  0.83  0.96  1.02  1.00
    576 x 1536   0.55  0.55  0.74  0.84  1.52  1.51  0.89  0.88  0.97

oneDNN picks a slower blocking for 384-512 rows of the 576-wide outputs, so such steps run as
pieces of at most SPLIT_ROWS rows. The packed weight replaces the plain bf16 copy (no extra
memory). Where packing is missing or gives other numbers (another torch, a GPU tensor), the
plain copy stays and `F.linear` runs as before.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

SPLIT_ROWS = 256  # steps of SPLIT_ROWS < rows < SPLIT_UNTIL run in pieces of SPLIT_ROWS rows
SPLIT_UNTIL = 768
PACK_FOR_ROWS = 32  # the batch-size hint of the reorder (decode batches)


def _packed_mm(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


@functools.cache
def packing_works(dtype: torch.dtype) -> bool:
    """Whether this torch packs `dtype` weights for oneDNN and its packed GEMM equals F.linear
    on the plain weight (exactly, for a few row counts)."""
    try:
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(96, 80, generator=gen).to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_FOR_ROWS)
        for rows in (1, 7, 33):
            x = torch.randn(rows, 80, generator=gen).to(dtype)
            if not torch.equal(_packed_mm(x, packed), F.linear(x, w)):
                log.info("oneDNN packed %s GEMM differs from F.linear here: plain weights", dtype)
                return False
        return True
    except (AttributeError, RuntimeError) as exc:
        log.info("oneDNN weight packing unavailable (%s): plain %s weights", exc, dtype)
        return False


class LowpWeight:
    """A linear layer's low-precision weight copy: packed for oneDNN where that works, else plain.
    Calling it multiplies rows `x` (in the weight's dtype) by the weight, `F.linear` style."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype) -> None:
        plain = weight.detach().to(dtype).contiguous()
        self.dtype = dtype
        self.packed = None
        self.plain: torch.Tensor | None = plain
        if (dtype == torch.bfloat16 and plain.device.type == "cpu" and plain.dim() == 2
                and packing_works(dtype)):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(plain, PACK_FOR_ROWS)
            self.plain = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.plain)
        x = x.contiguous()
        rows = x.shape[0]
        if SPLIT_ROWS < rows < SPLIT_UNTIL:
            return torch.cat([_packed_mm(x[i:i + SPLIT_ROWS], self.packed)
                              for i in range(0, rows, SPLIT_ROWS)])
        return _packed_mm(x, self.packed)

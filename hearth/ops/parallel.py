"""Parallel-group handles and the collectives the model layers call.

A `ParallelGroup` is built in `main` (or by the rank launcher) and passed down to the layers; there
is no global "current group". With size 1 every collective is the identity, so single-process code
pays nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelGroup:
    rank: int = 0
    size: int = 1
    group: object | None = None  # torch.distributed ProcessGroup when size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


SINGLE = ParallelGroup()

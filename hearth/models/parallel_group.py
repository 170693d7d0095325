"""Parallel-group handles and the collectives the model layers call.

A `ParallelGroup` is built by the rank launcher
(`hearth.engine.parallel.distributed.init_rank_groups`) and passed down to the layers; there is no
global "current group". With size 1 every collective is the identity and nothing is timed, so
single-process code pays nothing. It lives beside the layers that take it (models/ sits below
engine/, which builds the groups).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class CommStats:
    """Seconds spent in collectives and transfers, by kind (read and reset by benchmarks).

    On CUDA the timings only cover issuing the (asynchronous) operation; they are meaningful on
    CPU/gloo, where collectives are synchronous.
    """

    seconds: dict[str, float] = field(default_factory=dict)

    def add(self, kind: str, seconds: float) -> None:
        self.seconds[kind] = self.seconds.get(kind, 0.0) + seconds

    def take(self) -> dict[str, float]:
        out, self.seconds = self.seconds, {}
        return out


@dataclass(frozen=True)
class ParallelGroup:
    rank: int = 0
    size: int = 1
    group: object | None = None  # torch.distributed ProcessGroup when size > 1
    stats: CommStats | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            t0 = time.perf_counter()
            dist.all_reduce(x, group=self.group)
            if self.stats is not None:
                self.stats.add("tp_all_reduce", time.perf_counter() - t0)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        t0 = time.perf_counter()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        if self.stats is not None:
            self.stats.add("tp_all_gather", time.perf_counter() - t0)
        return torch.cat(parts, dim=-1)


SINGLE = ParallelGroup()

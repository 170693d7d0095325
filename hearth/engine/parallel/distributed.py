"""Process groups of a T x P rank set, the byte channels between ranks, and rank liveness.

Rank layout (global rank = stage * T + tp_rank):

    stage 0:  ranks 0 .. T-1      rank 0 is the driver (scheduler, KV block pool, prefix cache)
    stage 1:  ranks T .. 2T-1
    ...       stage P-1 is the last stage: it computes logits; its tp rank 0 samples

Every rank builds the same groups in the same order (torch.distributed requires it):

    world   backend (gloo | nccl), collective timeout   hidden states stage -> stage (send/recv)
    tp[s]   backend, collective timeout                 all-reduce / all-gather inside stage s
    cmd     gloo, no practical timeout                  step commands (workers idle here)
    ctl     gloo, collective timeout                    small CPU messages: load reports, tokens

Messages on cmd/ctl are msgspec bytes in uint8 tensors; nothing is ever unpickled. torch's
default process group is per-process state, so a process holds at most one rank set at a time.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from hearth.models.parallel_group import CommStats, ParallelGroup

log = logging.getLogger("hearth.distributed")

IDLE_TIMEOUT = timedelta(days=3650)  # workers wait on `cmd` for as long as the engine is idle


class RankFailedError(RuntimeError):
    """A rank died or a collective broke: the rank set cannot continue and must be rebuilt."""


@dataclass(frozen=True)
class RankLayout:
    tensor_parallel_size: int
    pipeline_parallel_size: int

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def stage(self, rank: int) -> int:
        return rank // self.tensor_parallel_size

    def tp_rank(self, rank: int) -> int:
        return rank % self.tensor_parallel_size

    def rank_of(self, stage: int, tp_rank: int) -> int:
        return stage * self.tensor_parallel_size + tp_rank

    @property
    def sampler_rank(self) -> int:
        return self.rank_of(self.pipeline_parallel_size - 1, 0)

    def describe(self, rank: int) -> str:
        return f"rank {rank} (stage {self.stage(rank)}, tp {self.tp_rank(rank)})"


@dataclass
class RankGroups:
    """This rank's handles; built once per process and passed down (no global lookup)."""

    rank: int
    layout: RankLayout
    device: torch.device
    tp: ParallelGroup  # this rank's stage
    cmd: object  # ProcessGroup
    ctl: object  # ProcessGroup
    comm: CommStats  # time spent in collectives and transfers (benchmarks)

    @property
    def stage(self) -> int:
        return self.layout.stage(self.rank)

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.layout.pipeline_parallel_size - 1

    def peer(self, stage_offset: int) -> int:
        """The rank with this tp rank in the neighbouring stage (+1 next, -1 previous)."""
        return self.layout.rank_of(self.stage + stage_offset, self.layout.tp_rank(self.rank))


def connect_store(host: str, port: int, is_master: bool, timeout_s: float) -> dist.TCPStore:
    """The rendezvous store; port 0 with is_master binds a free port (read it from `.port`)."""
    return dist.TCPStore(host, port, is_master=is_master, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout_s))


def init_rank_groups(store: dist.Store, rank: int, layout: RankLayout, device: torch.device,
                     timeout_s: float) -> RankGroups:
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=store, rank=rank, world_size=layout.world_size,
                            timeout=timeout)
    comm = CommStats()
    tp = ParallelGroup()
    for stage in range(layout.pipeline_parallel_size):
        ranks = [layout.rank_of(stage, t) for t in range(layout.tensor_parallel_size)]
        group = dist.new_group(ranks, timeout=timeout, backend=backend)
        if rank in ranks:
            tp = ParallelGroup(layout.tp_rank(rank), len(ranks), group, comm)
    everyone = list(range(layout.world_size))
    cmd = dist.new_group(everyone, timeout=IDLE_TIMEOUT, backend="gloo")
    ctl = dist.new_group(everyone, timeout=timeout, backend="gloo")
    return RankGroups(rank, layout, device, tp, cmd, ctl, comm)


def close_rank_groups() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


# ---- byte channels ------------------------------------------------------------------------
# A message is a header [kind, num_bytes] then the payload, both as tensors. The header lets the
# receiver size its buffer; `kind` is an enum value the caller defines.


def broadcast_message(kind: int, payload: bytes, group, src: int = 0) -> None:
    dist.broadcast(torch.tensor([kind, len(payload)], dtype=torch.int64), src, group=group)
    if payload:
        dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), src, group=group)


def receive_broadcast(group, src: int = 0) -> tuple[int, bytes]:
    header = torch.empty(2, dtype=torch.int64)
    dist.broadcast(header, src, group=group)
    kind, size = int(header[0]), int(header[1])
    if not size:
        return kind, b""
    payload = torch.empty(size, dtype=torch.uint8)
    dist.broadcast(payload, src, group=group)
    return kind, payload.numpy().tobytes()


def send_message(kind: int, payload: bytes, dst: int, group) -> list:
    """Non-blocking send; keep the returned works (and so the buffers) until they are waited."""
    header = torch.tensor([kind, len(payload)], dtype=torch.int64)
    body = torch.frombuffer(bytearray(payload or b"\0"), dtype=torch.uint8)
    return [dist.isend(header, dst, group=group), dist.isend(body, dst, group=group)]


def receive_message(src: int, group) -> tuple[int, bytes]:
    header = torch.empty(2, dtype=torch.int64)
    dist.recv(header, src, group=group)
    kind, size = int(header[0]), int(header[1])
    body = torch.empty(max(size, 1), dtype=torch.uint8)
    dist.recv(body, src, group=group)
    return kind, body[:size].numpy().tobytes()


# ---- liveness -----------------------------------------------------------------------------


class Heartbeat:
    """Every rank bumps a counter in the rendezvous store; a counter that stops moving for
    `stale_after_s` names a dead (or hung) rank. Works the same for spawned and torchrun ranks.

    Runs in a daemon thread with its own store connection, because the main thread may be blocked
    inside a collective exactly when a peer dies. `on_failure(message)` is called at most once.
    """

    def __init__(self, store_factory: Callable[[], dist.Store], rank: int, layout: RankLayout,
                 on_failure: Callable[[str], None], interval_s: float = 0.5,
                 stale_after_s: float = 5.0) -> None:
        self.store_factory = store_factory
        self.rank = rank
        self.layout = layout
        self.on_failure = on_failure
        self.interval_s = interval_s
        self.stale_after_s = stale_after_s
        self.failure: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"hearth-heartbeat-{rank}",
                                        daemon=True)

    def start(self) -> "Heartbeat":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        try:
            store = self.store_factory()
        except Exception as exc:  # the store host is already gone
            return self._fail(f"cannot reach the rendezvous store: {exc}")
        others = [r for r in range(self.layout.world_size) if r != self.rank]
        seen = {r: (-1, time.monotonic()) for r in others}
        while not self._stop.wait(self.interval_s):
            now = time.monotonic()
            try:
                store.add(f"hearth/heartbeat/{self.rank}", 1)
                counts = {r: store.add(f"hearth/heartbeat/{r}", 0) for r in others}
            except Exception as exc:
                if self._stop.is_set():
                    return
                return self._fail(f"lost the rendezvous store (hosted by rank 0 or the launcher):"
                                  f" {exc}")
            for r, count in counts.items():
                if count != seen[r][0]:
                    seen[r] = (count, now)
            stale = [r for r in others if now - seen[r][1] > self.stale_after_s]
            if stale and not self._stop.is_set():
                names = ", ".join(self.layout.describe(r) for r in stale)
                return self._fail(f"{names} stopped responding "
                                  f"(no heartbeat for {self.stale_after_s:g}s)")

    def _fail(self, message: str) -> None:
        self.failure = message
        self.on_failure(message)

"""One rank's share of the model: its stage's layers, its TP slice of each, and their KV cache.

Every rank (the driver included) runs `StageShard.run_step` on the same StepCommand. It first
applies the whole command's slot changes (`StepReceiver`, hearth/engine/step_state.py: the
block tables and penalty histories are sent as deltas), so every stage rebuilds the same tables
before any micro-batch runs. A step's requests are then cut into micro-batches; stage s runs
micro-batch m while stage s+1 runs m-1:

    time ->      t0     t1     t2     t3     t4
    stage 0    [mb0]  [mb1]  [mb2]  [mb3]
    stage 1           [mb0]  [mb1]  [mb2]  [mb3]     sends to the next stage are non-blocking,
                                                     so a stage starts m+1 while m travels

Between stages travel the hidden states and the residual stream of a micro-batch's tokens,
stacked as [2, num_tokens, hidden] (every TP rank sends its own identical copy to the same TP
rank of the next stage). The last stage projects the rows that sample to logits; its TP rank 0
samples and sends the tokens to the driver per micro-batch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hearth.engine.parallel.distributed import RankGroups
from hearth.engine.parallel.layout import split_layers
from hearth.engine.parallel.messages import RankStats, SampleResult, SampleRow, StepCommand
from hearth.engine.sampler import RowSampler
from hearth.engine.step_state import StepReceiver
from hearth.models.weights import build_model
from hearth.ops.attention import build_attention_metadata


@dataclass
class MicroBatch:
    first: int  # index of its first request in the StepCommand
    num_requests: int
    token_start: int  # its rows in StepCommand.input_ids
    num_tokens: int
    samples: list[SampleRow]
    sample_rows: list[int]  # rows (within the micro-batch) of every sampled position, in order


def micro_batches(cmd: StepCommand, samples: list[SampleRow]) -> list[MicroBatch]:
    """`samples`: the command's rows as `StepReceiver` made them whole."""
    token_starts = [0]
    for q in cmd.query_lens:
        token_starts.append(token_starts[-1] + q)
    by_index = {row.index: row for row in samples}
    out, first = [], 0
    for size in cmd.micro_batch_sizes:
        start = token_starts[first]
        samples = [by_index[i] for i in range(first, first + size) if i in by_index]
        rows = [r - start for s in samples
                for r in range(token_starts[s.index + 1] - s.num_positions,
                               token_starts[s.index + 1])]
        out.append(MicroBatch(first, size, start, token_starts[first + size] - start, samples,
                              rows))
        first += size
    return out


class StageShard:
    def __init__(self, checkpoint, groups: RankGroups, num_blocks: int, block_size: int,
                 dtype: torch.dtype, seed: int, expert_parallel: bool = False) -> None:
        self.groups = groups
        self.block_size = block_size
        self.device = groups.device
        self.dtype = dtype
        layout = groups.layout
        layer_range = split_layers(checkpoint.arch.num_layers,
                                   layout.pipeline_parallel_size)[groups.stage]
        self.model = build_model(checkpoint, dtype, str(self.device), groups.tp, layer_range,
                                 expert_parallel)
        arch = self.model.arch
        self.hidden_size = arch.hidden_size
        planes, heads, dim = arch.kv_cache_layout(groups.tp.size)
        self.kv_cache = torch.zeros(len(self.model.layers), planes, num_blocks, block_size,
                                    heads, dim, dtype=dtype, device=self.device)
        is_sampler = groups.rank == layout.sampler_rank
        self.sampler = RowSampler(seed, arch.vocab_size) if is_sampler else None
        self.receiver = StepReceiver(block_size)
        self.compute_s = 0.0
        self.step_s = 0.0
        self.num_steps = 0

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    @torch.inference_mode()
    def run_step(self, cmd: StepCommand, on_result) -> None:
        """Run this rank's part of the step. The sampler rank calls `on_result(SampleResult)`
        once per micro-batch that samples, in order."""
        step_start = time.perf_counter()
        step = self.receiver.receive(cmd)  # before anything else, on every rank alike
        pending = []  # in-flight sends: their tensors must stay alive until waited
        for mb in micro_batches(cmd, step.samples):
            hidden, residual = (None, None) if self.groups.is_first_stage else self._receive(mb)
            result = self._compute(cmd, step.block_tables, mb, hidden, residual)
            if isinstance(result, tuple):
                pending.append(self._send(*result))
            elif result is not None:
                on_result(result)
        t0 = time.perf_counter()
        for work, _ in pending:
            work.wait()
        self.groups.comm.add("pp_send", time.perf_counter() - t0)
        self.num_steps += 1
        self.step_s += time.perf_counter() - step_start

    def take_stats(self, rank: int) -> RankStats:
        stats = RankStats(rank, self.num_steps, self.step_s, self.compute_s,
                          self.groups.comm.take())
        self.num_steps, self.step_s, self.compute_s = 0, 0.0, 0.0
        return stats

    def _compute(self, cmd: StepCommand, block_tables: list[list[int]], mb: MicroBatch, hidden,
                 residual):
        """(hidden, residual) for the next stage, or the last stage's SampleResult (or None)."""
        t0 = time.perf_counter()
        comm0 = sum(self.groups.comm.seconds.values())
        input_ids, positions, meta = self._inputs(cmd, block_tables, mb)
        hidden, residual = self.model(input_ids, positions, meta, self.kv_cache, hidden,
                                      residual)
        out = (hidden, residual) if not self.groups.is_last_stage else None
        if self.groups.is_last_stage and mb.samples:
            out = self._sample(hidden, mb)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # so the time below is the kernels' time
        comm = sum(self.groups.comm.seconds.values()) - comm0
        self.compute_s += time.perf_counter() - t0 - comm
        return out

    def _inputs(self, cmd: StepCommand, block_tables: list[list[int]], mb: MicroBatch):
        lo, hi = mb.first, mb.first + mb.num_requests
        query_lens, context_lens = cmd.query_lens[lo:hi], cmd.context_lens[lo:hi]
        meta = build_attention_metadata(query_lens, context_lens, block_tables[lo:hi],
                                        self.block_size, self.device)
        positions = torch.cat([torch.arange(c - q, c) for q, c in zip(query_lens, context_lens)])
        input_ids = None
        if self.groups.is_first_stage:
            ids = cmd.input_ids[mb.token_start : mb.token_start + mb.num_tokens]
            input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        return input_ids, positions.to(self.device), meta

    def _receive(self, mb: MicroBatch):
        t0 = time.perf_counter()
        buf = torch.empty(2, mb.num_tokens, self.hidden_size, dtype=self.dtype,
                          device=self.device)
        dist.recv(buf, self.groups.peer(-1))
        self.groups.comm.add("pp_recv", time.perf_counter() - t0)
        return buf[0], buf[1]

    def _send(self, hidden: torch.Tensor, residual: torch.Tensor):
        t0 = time.perf_counter()
        buf = torch.stack([hidden, residual])
        work = dist.isend(buf, self.groups.peer(+1))
        self.groups.comm.add("pp_send", time.perf_counter() - t0)
        return work, buf

    def _sample(self, hidden: torch.Tensor, mb: MicroBatch) -> SampleResult | None:
        rows = torch.tensor(mb.sample_rows, device=hidden.device)
        logits = self.model.compute_logits(hidden[rows])  # all TP ranks join the all-gather
        if self.sampler is None:
            return None
        return self.sampler.sample(logits.float().cpu(), mb.samples)

"""The driver of a T x P rank set: the engine's executor when tensor/pipeline parallelism is on.

The driver is rank 0 (first stage, TP rank 0) and lives in the engine's process: the scheduler,
KV block pool and prefix cache stay single and local. Per engine step it broadcasts the
StepCommand (hearth/engine/step.py, built by the engine exactly as for the in-process runner), runs stage 0's shard itself, and gathers
the sampled tokens (from its own shard when P = 1, else from the last stage).

Failure contract: any error after a command has gone out leaves the ranks out of step, so it is
fatal: the executor names the failed rank (watchdog exit codes, else the heartbeat), kills the
ranks it spawned and raises `RankFailedError` now and on every later call. Errors before the
broadcast (a request's grammar) or in sampling (reported back in SampleResult) fail the step only.
"""

from __future__ import annotations

import logging
import os
import time
import weakref

import torch

from hearth.config import EngineConfig
from hearth.engine.parallel.distributed import (Heartbeat, RankFailedError, RankLayout,
                                                broadcast_message, close_rank_groups,
                                                connect_store, init_rank_groups, receive_message)
from hearth.engine.parallel.layout import check_parallel_shape
from hearth.engine.parallel.local_ranks import LocalRanks
from hearth.engine.parallel.messages import (CollectStats, Command, LoadModel, RankStats, Reply,
                                             SampleResult, Shutdown, StepCommand, decode_reply,
                                             encode)
from hearth.engine.parallel.stage import StageShard
from hearth.engine.parallel.rank import RankSpec, rank_device
from hearth.engine.runner import DTYPES

log = logging.getLogger("hearth.executor")


class ParallelExecutor:
    def __init__(self, config: EngineConfig, checkpoint, num_blocks: int) -> None:
        pc = config.parallel
        self.layout = RankLayout(pc.tensor_parallel_size, pc.pipeline_parallel_size)
        check_parallel_shape(checkpoint.arch, pc.tensor_parallel_size,
                             pc.pipeline_parallel_size, pc.enable_expert_parallel)
        self.num_blocks = num_blocks
        self.block_size = config.cache.block_size
        self.vocab_size = checkpoint.arch.vocab_size
        # Micro-batches only pay off when there are stages to overlap.
        self.num_micro_batches = 1
        if pc.pipeline_parallel_size > 1:
            self.num_micro_batches = pc.num_micro_batches or pc.pipeline_parallel_size
        self.failure: str | None = None
        self.local_ranks: LocalRanks | None = None
        self.heartbeat: Heartbeat | None = None
        self._saved_threads = torch.get_num_threads()
        self._closed = False
        try:
            self._start(config, checkpoint)
        except BaseException:
            self._teardown()
            raise

    # ---- startup ----------------------------------------------------------------------------
    def _start(self, config: EngineConfig, checkpoint) -> None:
        pc, mc = config.parallel, config.model
        timeout = pc.collective_timeout_s
        if pc.master_addr is None:
            store = connect_store("127.0.0.1", 0, True, timeout)
            host, port = "127.0.0.1", store.port
            self._spawn(pc, host, port)
            self.local_ranks.wait_joined(store, max(timeout, 120.0))
        else:
            host, port = pc.master_addr, pc.master_port
            store = connect_store(host, port, not pc.agent_store, timeout)
        self.groups = init_rank_groups(store, 0, self.layout, rank_device(pc.device, 0), timeout)
        self.heartbeat = Heartbeat(lambda: connect_store(host, port, False, timeout), 0,
                                   self.layout, self._on_failure).start()
        load = LoadModel(mc.model, mc.dtype, self.num_blocks, self.block_size, mc.seed,
                         pc.enable_expert_parallel, mc.rope_scaling)
        broadcast_message(Command.LOAD_MODEL, encode(load), self.groups.cmd)
        errors = []
        try:
            self.shard = StageShard(checkpoint, self.groups, self.num_blocks, self.block_size,
                                    DTYPES[mc.dtype], mc.seed, pc.enable_expert_parallel)
        except Exception as exc:
            errors.append(f"{self.layout.describe(0)}: {type(exc).__name__}: {exc}")
        for rank in range(1, self.layout.world_size):
            report = self._receive(rank, Reply.LOAD_REPORT)
            if report.error is not None:
                errors.append(f"{self.layout.describe(rank)}: {report.error}")
        if errors:
            self._shutdown_ranks("load failed")
            raise ValueError("loading the model shards failed: " + "; ".join(errors))
        log.info("rank set ready: tensor parallel %d x pipeline parallel %d, %d micro-batches",
                 self.layout.tensor_parallel_size, self.layout.pipeline_parallel_size,
                 self.num_micro_batches)

    def _spawn(self, pc, host: str, port: int) -> None:
        # Ranks share this machine's cores: oversubscribed OpenMP threads spin against each other.
        threads = max(1, (os.cpu_count() or 1) // self.layout.world_size)
        specs = [RankSpec(rank, pc.tensor_parallel_size, pc.pipeline_parallel_size, host, port,
                          device=pc.device, local_rank=rank, timeout_s=pc.collective_timeout_s,
                          num_threads=threads)
                 for rank in range(1, self.layout.world_size)]
        self.local_ranks = LocalRanks(specs, self.layout, self._on_failure)
        weakref.finalize(self, self.local_ranks.kill)  # never leave children behind
        torch.set_num_threads(threads)

    # ---- stepping ---------------------------------------------------------------------------
    def execute(self, cmd: StepCommand) -> SampleResult:
        if self.failure is not None:
            raise RankFailedError(self.failure)
        t0 = time.perf_counter()
        try:
            broadcast_message(Command.STEP, encode(cmd), self.groups.cmd)
            self.groups.comm.add("cmd", time.perf_counter() - t0)
            results: list[SampleResult] = []
            self.shard.run_step(cmd, results.append)
            if self.layout.pipeline_parallel_size > 1:
                results = self._receive_results(cmd)
        except Exception as exc:
            raise self._fail(exc) from exc
        errors = [r.error for r in results if r.error is not None]
        if errors:  # sampling failed on the sampler rank: this step fails, the ranks stay up
            return SampleResult([], error=errors[0])
        return SampleResult([row for r in results for row in r.rows])

    def _receive_results(self, cmd: StepCommand) -> list[SampleResult]:
        t0 = time.perf_counter()
        first, num_sampling = 0, 0
        sampled_indices = {row.index for row in cmd.samples}
        for size in cmd.micro_batch_sizes:
            num_sampling += any(i in sampled_indices for i in range(first, first + size))
            first += size
        results = [self._receive(self.layout.sampler_rank, Reply.SAMPLE_RESULT)
                   for _ in range(num_sampling)]
        self.groups.comm.add("results", time.perf_counter() - t0)
        return results

    def _receive(self, src: int, expected: Reply):
        return decode_reply(*receive_message(src, self.groups.ctl), expected)

    def collect_stats(self) -> list[RankStats]:
        """Every rank's time split since the last call (benchmarks)."""
        broadcast_message(Command.COLLECT_STATS, encode(CollectStats()), self.groups.cmd)
        stats = [self.shard.take_stats(0)]
        for rank in range(1, self.layout.world_size):
            stats.append(self._receive(rank, Reply.RANK_STATS))
        return stats

    # ---- PD -----------------------------------------------------------------------------------
    @property
    def kv_cache(self) -> torch.Tensor:
        raise RuntimeError("KV transfer (prefill/decode roles) needs tensor_parallel_size=1 and "
                           "pipeline_parallel_size=1: with T x P ranks the KV cache is spread "
                           "over processes (see docs/parallelism.md)")

    def expert_load(self) -> dict[int, list[int]]:
        """Not counted across ranks (the ranks run the torch expert reference)."""
        return {}

    def block_view(self, block_id: int) -> torch.Tensor:
        return self.kv_cache[:, :, block_id]

    # ---- failure and shutdown -----------------------------------------------------------------
    def _on_failure(self, why: str) -> None:
        """From the watchdog or heartbeat thread: record why, and kill the spawned ranks so a
        main thread blocked on a hung peer gets a closed connection instead of a timeout."""
        if self.failure is None:
            self.failure = why
            log.error("rank set failed: %s", why)
        if self.local_ranks is not None:
            self.local_ranks.kill()

    def _fail(self, exc: Exception) -> RankFailedError:
        """Name the cause of a failed step, tear the rank set down, return the error to raise."""
        deadline = time.monotonic() + (2.0 if self.local_ranks is not None
                                       else self.heartbeat.stale_after_s + 1.0)
        while self.failure is None and time.monotonic() < deadline:
            dead = self.local_ranks.dead() if self.local_ranks is not None else []
            if dead:
                self.failure = "; ".join(dead)
            time.sleep(0.05)
        if self.failure is None:
            self.failure = f"{type(exc).__name__}: {exc}"
        log.error("tensor/pipeline-parallel step failed: %s", self.failure)
        self._teardown()
        return RankFailedError(self.failure)

    def close(self) -> None:
        if self._closed:
            return
        if self.failure is None and getattr(self, "groups", None) is not None:
            try:
                self._shutdown_ranks("close")
            except Exception:
                log.exception("could not tell the ranks to shut down; killing them")
        self._teardown()

    def _shutdown_ranks(self, reason: str) -> None:
        # Their exits are expected from now on: silence the watchdog and heartbeat first.
        if self.local_ranks is not None:
            self.local_ranks.stop_watching()
        if self.heartbeat is not None:
            self.heartbeat.stop()
        broadcast_message(Command.SHUTDOWN, encode(Shutdown(reason)), self.groups.cmd)

    def _teardown(self) -> None:
        self._closed = True
        if self.heartbeat is not None:
            self.heartbeat.stop()
        if self.local_ranks is not None:
            if self.failure is None:
                self.local_ranks.close()
            else:
                self.local_ranks.kill()
            torch.set_num_threads(self._saved_threads)
        close_rank_groups()

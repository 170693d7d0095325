"""A non-driver rank: joins the rank set, loads its shard, and runs the driver's commands.

Started by the driver on one machine (`python -m hearth.engine.parallel.rank SPEC_JSON`) or by
`hearth` itself under torchrun for every RANK but 0. Exit status: 0 after SHUTDOWN, 1 when the
rank set breaks (a peer died: the heartbeat names it on stderr, within seconds).
"""

from __future__ import annotations

import logging
import os
import sys
import time

import msgspec
import torch

from hearth.engine.parallel.distributed import (Heartbeat, RankGroups, RankLayout,
                                                close_rank_groups, connect_store,
                                                init_rank_groups, receive_broadcast, send_message)
from hearth.logs import setup_logging
from hearth.engine.parallel.messages import (Command, LoadModel, LoadReport, Reply, StepCommand,
                                             decode_command, encode)

log = logging.getLogger("hearth.rank")


class RankSpec(msgspec.Struct, frozen=True):
    """How one process joins the rank set (everything else comes from the driver's LOAD_MODEL)."""

    rank: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    store_host: str
    store_port: int
    store_is_master: bool = False  # torchrun without an agent store: rank 0 hosts it
    device: str = "cpu"  # cpu | cuda
    local_rank: int = 0  # CUDA device index on this machine
    timeout_s: float = 60.0  # collectives; a step part waiting longer than this fails
    num_threads: int = 0  # torch intra-op threads; 0 leaves the default


def rank_device(kind: str, local_rank: int) -> torch.device:
    return torch.device("cuda", local_rank) if kind == "cuda" else torch.device("cpu")


STORE_CHECK_TIMEOUT_S = 2.0  # a last look at the store after a failed step


def _exit_with(message: str) -> None:
    """Called from the heartbeat thread while the main thread may sit in a dead collective."""
    sys.stderr.write(f"hearth: {message}; exiting\n")
    sys.stderr.flush()
    os._exit(1)


def serve_rank(spec: RankSpec) -> int:
    if spec.num_threads:
        torch.set_num_threads(spec.num_threads)
    layout = RankLayout(spec.tensor_parallel_size, spec.pipeline_parallel_size)
    me = layout.describe(spec.rank)
    store = connect_store(spec.store_host, spec.store_port, spec.store_is_master, spec.timeout_s)
    store.set(f"hearth/joined/{spec.rank}", "1")
    groups = init_rank_groups(store, spec.rank, layout, rank_device(spec.device, spec.local_rank),
                              spec.timeout_s)
    heartbeat = Heartbeat(
        lambda: connect_store(spec.store_host, spec.store_port, False, spec.timeout_s),
        spec.rank, layout, on_failure=lambda why: _exit_with(f"{me}: {why}")).start()
    try:
        run_commands(groups)
    except Exception as exc:
        # Most likely a peer died inside a collective; the heartbeat names which one.
        log.error("%s: step failed (%s: %s); waiting for the heartbeat to name the cause", me,
                  type(exc).__name__, exc)
        time.sleep(heartbeat.stale_after_s + 2 * heartbeat.interval_s)
        # Silent heartbeat: its own store call may still be blocked (a client can retry a dead
        # master until its timeout; a full suite run once saw a rank exit naming only the gloo
        # error after its driver was killed). Ask the store once more, briefly.
        try:
            connect_store(spec.store_host, spec.store_port, False, STORE_CHECK_TIMEOUT_S).add(
                f"hearth/heartbeat/{spec.rank}", 0)
        except Exception as lost:  # noqa: BLE001
            _exit_with(f"{me}: lost the rendezvous store (hosted by rank 0 or the launcher): "
                       f"{lost}")
        _exit_with(f"{me}: {type(exc).__name__}: {exc}")
    heartbeat.stop()
    close_rank_groups()
    return 0


def run_commands(groups: RankGroups) -> None:
    shard = None
    while True:
        command, message = decode_command(*receive_broadcast(groups.cmd))
        if command is Command.SHUTDOWN:
            return
        if command is Command.LOAD_MODEL:
            shard = load_shard(groups, message)
        elif command is Command.STEP:
            run_step(groups, shard, message)
        elif command is Command.COLLECT_STATS:
            stats = shard.take_stats(groups.rank)
            for work in send_message(Reply.RANK_STATS, encode(stats), 0, groups.ctl):
                work.wait()


def load_shard(groups: RankGroups, spec: LoadModel):
    from hearth.engine.parallel.stage import StageShard
    from hearth.engine.runner import DTYPES
    from hearth.models.loader import load_checkpoint, with_rope_scaling

    shard, report = None, None
    try:
        torch.manual_seed(spec.seed)
        checkpoint = with_rope_scaling(load_checkpoint(spec.model), spec.rope_scaling)
        shard = StageShard(checkpoint, groups, spec.num_blocks, spec.block_size,
                           DTYPES[spec.dtype], spec.seed, spec.expert_parallel)
        report = LoadReport(groups.rank, None, shard.num_parameters, shard.kv_cache.nbytes)
    except Exception as exc:  # reported to the driver, which ends the rank set cleanly
        log.exception("%s: loading failed", groups.layout.describe(groups.rank))
        report = LoadReport(groups.rank, f"{type(exc).__name__}: {exc}")
    for work in send_message(Reply.LOAD_REPORT, encode(report), 0, groups.ctl):
        work.wait()
    return shard


def run_step(groups: RankGroups, shard, cmd: StepCommand) -> None:
    pending = []

    def send_result(result) -> None:  # the sampler rank of a P > 1 set
        pending.extend(send_message(Reply.SAMPLE_RESULT, encode(result), 0, groups.ctl))

    shard.run_step(cmd, send_result)
    for work in pending:
        work.wait()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    spec = msgspec.json.decode(args[0], type=RankSpec)
    setup_logging("info", tag=f"rank{spec.rank}")
    return serve_rank(spec)


if __name__ == "__main__":
    sys.exit(main())

"""The typed messages between the driver (rank 0) and the other ranks.

    driver -> all ranks (broadcast on `cmd`):  LOAD_MODEL once, then STEP per engine step,
                                               COLLECT_STATS on demand, SHUTDOWN at the end
                                               (a STEP's tables are deltas: every rank applies
                                               every STEP, hearth/engine/step_state.py)
    rank -> driver (send on `ctl`):            LOAD_REPORT (every rank, after LOAD_MODEL)
                                               SAMPLE_RESULT (the sampler rank, per micro-batch)
                                               RANK_STATS (every rank, after COLLECT_STATS)

Each message is one msgspec Struct, sent as msgpack bytes behind an enum header
(`hearth.engine.parallel.distributed.broadcast_message`); a receiver decodes only the type the
header names.
"""

from __future__ import annotations

import enum

import msgspec

from hearth.engine.step import SampleResult, SampleRow, StepCommand  # the step contract

__all__ = ["SampleResult", "SampleRow", "StepCommand"]


class Command(enum.IntEnum):
    LOAD_MODEL = 1
    STEP = 2
    COLLECT_STATS = 3
    SHUTDOWN = 4


class Reply(enum.IntEnum):
    LOAD_REPORT = 16
    SAMPLE_RESULT = 17
    RANK_STATS = 18


class LoadModel(msgspec.Struct, frozen=True):
    model: str  # what `hearth.models.loader.load_checkpoint` opens on every rank
    dtype: str
    num_blocks: int  # the driver's pool size: block ids are the same on every rank
    block_size: int
    seed: int  # the sampler rank's shared generator, as ModelRunner seeds it
    expert_parallel: bool = False  # a MoE model's experts split whole across the TP ranks
    rope_scaling: str | None = None  # --rope-scaling JSON, applied to the checkpoint's arch


class LoadReport(msgspec.Struct, frozen=True):
    rank: int
    error: str | None = None  # why this rank could not load its shard
    num_parameters: int = 0
    kv_cache_bytes: int = 0


class RankStats(msgspec.Struct, frozen=True):
    """Where one rank's time went since the previous COLLECT_STATS."""

    rank: int
    num_steps: int
    step_s: float  # wall time inside steps
    compute_s: float  # model forward and sampling, minus the collectives inside them
    comm_s: dict[str, float]  # tp_all_reduce, tp_all_gather, pp_recv, pp_send, results


class CollectStats(msgspec.Struct, frozen=True):
    reset: bool = True


class Shutdown(msgspec.Struct, frozen=True):
    reason: str = ""


COMMAND_TYPES = {Command.LOAD_MODEL: LoadModel, Command.STEP: StepCommand,
                 Command.COLLECT_STATS: CollectStats, Command.SHUTDOWN: Shutdown}
_DECODERS = {kind: msgspec.msgpack.Decoder(t) for kind, t in COMMAND_TYPES.items()}
_REPLY_DECODERS = {Reply.LOAD_REPORT: msgspec.msgpack.Decoder(LoadReport),
                   Reply.SAMPLE_RESULT: msgspec.msgpack.Decoder(SampleResult),
                   Reply.RANK_STATS: msgspec.msgpack.Decoder(RankStats)}
encode = msgspec.msgpack.Encoder().encode


def decode_command(kind: int, payload: bytes):
    return Command(kind), _DECODERS[Command(kind)].decode(payload)


def decode_reply(kind: int, payload: bytes, expected: Reply):
    if kind != expected:
        raise RuntimeError(f"protocol error: expected {expected.name}, got reply kind {kind}")
    return _REPLY_DECODERS[expected].decode(payload)

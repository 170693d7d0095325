"""The typed messages between the driver (rank 0) and the other ranks.

    driver -> all ranks (broadcast on `cmd`):  LOAD_MODEL once, then STEP per engine step,
                                               COLLECT_STATS on demand, SHUTDOWN at the end
    rank -> driver (send on `ctl`):            LOAD_REPORT (every rank, after LOAD_MODEL)
                                               SAMPLE_RESULT (the sampler rank, per micro-batch)
                                               RANK_STATS (every rank, after COLLECT_STATS)

Each message is one msgspec Struct, sent as msgpack bytes behind an enum header
(`hearth.ops.distributed.broadcast_message`); a receiver decodes only the type the header names.
"""

from __future__ import annotations

import enum

import msgspec


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


class LoadReport(msgspec.Struct, frozen=True):
    rank: int
    error: str | None = None  # why this rank could not load its shard
    num_parameters: int = 0
    kv_cache_bytes: int = 0


class SampleRow(msgspec.Struct, frozen=True):
    """What the sampler rank needs to sample one request: the fields `make_sampling_batch`
    reads, plus the history and grammar mask the driver holds."""

    index: int  # position of the request in StepCommand's request lists
    request_id: str  # keys the sampler's per-request seeded generator
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logprobs: int | None
    seed: int | None
    prompt_ids: list[int] = []  # token history, sent only when a penalty needs it
    output_ids: list[int] = []
    allowed: bytes | None = None  # guided decoding: np.packbits of the allowed-token mask [vocab]

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1


class StepCommand(msgspec.Struct, frozen=True):
    """One engine step. Request i computes tokens [context_lens[i] - query_lens[i],
    context_lens[i]); its KV goes to block_tables[i], identical on every rank."""

    input_ids: list[int]  # [sum(query_lens)], requests back to back
    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    micro_batch_sizes: list[int]  # requests per micro-batch, in order; sums to len(query_lens)
    samples: list[SampleRow]  # requests that sample a token this step, by index
    finished_ids: list[str] = []  # drop the sampler's state for these before sampling


class SampleResult(msgspec.Struct, frozen=True):
    """Tokens of one micro-batch's SampleRows, in their order."""

    token_ids: list[int]
    logprobs: list[float] = []  # of each sampled token, when any row asked for logprobs
    top_ids: list[list[int]] = []  # [row][k] when any row asked for k > 0
    top_logprobs: list[list[float]] = []
    error: str | None = None  # sampling failed (bad parameters): the step fails, ranks stay up


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

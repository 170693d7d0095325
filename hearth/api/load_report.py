"""LoadReport: a worker's `GET /load` body, the one type both the worker and the router use.

The worker builds it from its engine's `EngineStats` (every stats field, flat, at the top level)
plus what only the server knows; the router decodes a poll's body into it (a body that does not
decode is a worker that is not speaking this contract: the endpoint is marked down with the
reason). `block_size` is here so the router can refuse a worker whose KV blocks differ from its
own: the router hashes prompts in blocks of its own size, so a mismatch would silently match no
block of that worker's cache.

    GET /load[?check_pool=1][&events_since=N]
    {...EngineStats fields..., "role": "decode", "block_size": 16, "num_requests_inflight": 3,
     "kv_pool_is_whole": true,                                  (only with check_pool=1)
     "block_events": {"cursor": 42, "stored": [...], "evicted": [...],
                      "tiers": {"disk": {"stored": [...], "evicted": [...]}}}}
                                                  (only with events_since; "tiers" only if any)
"""

from __future__ import annotations

import msgspec

from hearth.config import Role
from hearth.engine.stats import EngineStats


class TierEvents(msgspec.Struct):
    stored: list[int] = []  # block hashes written to this KV tier since the cursor
    evicted: list[int] = []  # block hashes dropped from it since the cursor


class BlockEvents(msgspec.Struct):
    """Prefix-cache changes since the `events_since` cursor (the router's cache view)."""

    cursor: int  # ask from here next time; lower than the last one: the worker restarted
    stored: list[int] = []  # block hashes entered in the prefix cache since the cursor
    evicted: list[int] = []  # block hashes evicted from it since the cursor
    # the same for the KV tiers below the pool, by tier name (docs/kv_tiers.md); omitted if none
    tiers: dict[str, TierEvents] | msgspec.UnsetType = msgspec.UNSET


class LoadReport(EngineStats, kw_only=True):
    role: Role  # which hops the worker serves
    block_size: int  # tokens per KV block: must equal the router's (--block-size)
    num_requests_inflight: int = 0  # engine requests the server has open (queued or running)
    kv_pool_is_whole: bool | msgspec.UnsetType = msgspec.UNSET  # only with ?check_pool=1
    block_events: BlockEvents | msgspec.UnsetType = msgspec.UNSET  # only with ?events_since=N


_decoder = msgspec.json.Decoder(LoadReport)


def encode_load_report(report: LoadReport) -> bytes:
    return msgspec.json.encode(report)


def decode_load_report(body: bytes) -> LoadReport:
    """(router) A /load body; ValueError naming what is wrong if it is not a LoadReport."""
    try:
        return _decoder.decode(body)
    except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
        raise ValueError(f"/load is not a load report: {exc}") from None

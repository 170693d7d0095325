"""Real coding-agent sessions (../shared/traces, kv-cache-tester format) scaled down to a small model.

A trace carries no text, only the shape of each request: one hash id per 64-token block of its
prompt, local to the session. The replay turns each block into `tokens_per_block` words derived
from the block's identity, so two requests share prompt text exactly where the trace says they
share blocks:

    trace block ids   [1 2 3 ... 330 | 331 332 ...]      harness prefix | session history
    block identity    ("harness", p) | (session, hash_id)
    text              " w w w w"  (tokens_per_block words, seeded by the identity)

The harness prefix (system prompt + tool definitions, `system_tokens + tool_tokens`) is keyed by
position alone, so every session starts with the same text, as every session of one agent would.
A harness position keeps its shared key only while the session still carries its first request's
block there (a rewrite of the prefix later in the session stays private).

`hit_ceiling` is what an infinite prefix cache would reuse over the same order of requests:
per request, the longest run of leading blocks that some earlier request also began with.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

BLOCK_TOKENS = 64  # tokens per hash id in the trace files
WORDS = ("time person year way day thing man world life hand part child eye woman place work week "
         "case point number group problem fact table river stone light music garden window paper "
         "market letter road engine system model token cache server agent answer question").split()


@dataclass(frozen=True)
class ReplayConfig:
    num_sessions: int = 8
    requests_per_session: int = 8
    tokens_per_block: int = 4  # 64 real tokens -> 4 replayed: contexts shrink 16x
    output_scale: float = 1 / 16
    min_output_tokens: int = 4
    max_output_tokens: int = 64
    think_time_scale: float = 0.0  # 0: each session sends its next request at once

    def describe(self) -> str:
        return (f"{self.num_sessions} sessions x {self.requests_per_session} requests; each 64-token "
                f"block -> {self.tokens_per_block} words (contexts /{BLOCK_TOKENS / self.tokens_per_block:g}); "
                f"outputs x{self.output_scale:g} clamped to [{self.min_output_tokens}, "
                f"{self.max_output_tokens}]; think times x{self.think_time_scale:g}")


@dataclass(frozen=True)
class ReplayRequest:
    session_id: str
    index: int  # position in the session
    block_keys: tuple[tuple, ...]  # identity of each prompt block, in order
    prompt: str
    max_tokens: int
    think_seconds: float  # wait before sending, after the previous response


def block_text(key: tuple, num_words: int) -> str:
    seed = int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=8).digest(), "little")
    rng = random.Random(seed)
    return "".join(" " + rng.choice(WORDS) for _ in range(num_words))


def session_requests(trace: dict, cfg: ReplayConfig, salt: str = "") -> list[ReplayRequest]:
    """`salt` changes every block's text: repeats of a replay must not hit each other's cache."""
    session_id = trace["id"]
    raw = trace["requests"][:cfg.requests_per_session]
    harness_blocks = math.ceil((trace.get("system_tokens", 0) + trace.get("tool_tokens", 0)) / BLOCK_TOKENS)
    first_ids = raw[0]["hash_ids"] if raw else []
    requests = []
    for index, entry in enumerate(raw):
        keys = tuple(
            ("harness", pos) if pos < harness_blocks and pos < len(first_ids) and first_ids[pos] == hid
            else (session_id, hid)
            for pos, hid in enumerate(entry["hash_ids"]))
        out = round(entry["out"] * cfg.output_scale)
        requests.append(ReplayRequest(
            session_id=session_id, index=index, block_keys=keys,
            prompt="".join(block_text((salt, *k), cfg.tokens_per_block) for k in keys).lstrip(),
            max_tokens=max(cfg.min_output_tokens, min(cfg.max_output_tokens, out)),
            think_seconds=entry.get("think_time", 0.0) * cfg.think_time_scale))
    return requests


def load_sessions(trace_dir: str | Path, cfg: ReplayConfig, salt: str = "") -> list[list[ReplayRequest]]:
    """The first `num_sessions` traces by file name, each cut to `requests_per_session`."""
    paths = sorted(Path(trace_dir).glob("trace_*.json"))[:cfg.num_sessions]
    if len(paths) < cfg.num_sessions:
        raise ValueError(f"{trace_dir}: {len(paths)} traces, {cfg.num_sessions} sessions asked")
    return [session_requests(json.loads(p.read_text()), cfg, salt) for p in paths]


def hit_ceiling(requests_in_order: list[ReplayRequest]) -> float:
    """Fraction of prompt blocks an infinite prefix cache would reuse, requests in send order."""
    seen: set[int] = set()  # chained hash of every block prefix some earlier request began with
    hits = total = 0
    for request in requests_in_order:
        chain, prefix_hashes = 0, []
        for key in request.block_keys:
            chain = hash((chain, key))
            prefix_hashes.append(chain)
        # A cached prefix implies its shorter prefixes are cached too: count the leading run.
        hits += next((n for n, h in enumerate(prefix_hashes) if h not in seen), len(prefix_hashes))
        total += len(prefix_hashes)
        seen.update(prefix_hashes)
    return hits / total if total else 0.0

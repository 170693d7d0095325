"""An incremental n-gram index over a growing token list: where did the context's tail occur?

`TokenIndex` maps every `key_len`-gram of a sequence to the positions where it ends, updated as
the sequence grows (O(1) per token). `candidates(context)` returns earlier occurrences of the
context's last `key_len` tokens, most recent first, each with its match length (how far back
the occurrence agrees with the context) — what a suffix tree answers for the deepest node, at
a fraction of its memory.
"""

from __future__ import annotations

from dataclasses import dataclass

SEPARATOR = -1  # between sequences in a shared buffer; never a token, so no match crosses it


@dataclass
class Candidate:
    seq: list[int]  # the sequence the occurrence is in
    end: int  # index of its last matched token in `seq`
    match_len: int  # tokens that agree with the context's tail, ending at `end`


class TokenIndex:
    def __init__(self, key_len: int) -> None:
        self.key_len = key_len
        self.seq: list[int] = []
        self.positions: dict[tuple[int, ...], list[int]] = {}
        self.num_indexed = 0  # tokens of `seq` whose key is in `positions`

    def extend_from(self, tokens: list[int]) -> None:
        """Index `tokens` (a sequence this index follows, e.g. a request's all_token_ids, which
        only grows) up to its current end."""
        self.seq = tokens
        self._index_to(len(tokens))

    def append(self, tokens: list[int]) -> None:
        self.seq.extend(tokens)
        self._index_to(len(self.seq))

    def _index_to(self, end: int) -> None:
        n, seq, positions = self.key_len, self.seq, self.positions
        for i in range(max(self.num_indexed, n - 1), end):
            key = tuple(seq[i - n + 1 : i + 1])
            if SEPARATOR in key:
                continue
            positions.setdefault(key, []).append(i)
        self.num_indexed = max(self.num_indexed, end)

    def candidates(self, context: list[int], max_candidates: int, max_match: int,
                   exclude_end: int | None = None) -> list[Candidate]:
        """Occurrences of the context's tail with at least one token after them, most recent
        first. `exclude_end`: the context's own end, when the context is this sequence."""
        n = self.key_len
        if len(context) < n:
            return []
        found = self.positions.get(tuple(context[-n:]))
        if not found:
            return []
        out, seq = [], self.seq
        for end in reversed(found):
            if end == exclude_end or end + 1 >= len(seq) or seq[end + 1] == SEPARATOR:
                continue
            length = n
            while (length < max_match and length < len(context) and end - length >= 0
                   and seq[end - length] == context[-1 - length]):
                length += 1
            out.append(Candidate(seq, end, length))
            if len(out) >= max_candidates:
                break
        return out

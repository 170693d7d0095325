"""Draft proposers: model-free guesses of a request's next tokens from text it has seen.

- `NgramProposer` (prompt lookup): find the most recent earlier occurrence of the longest tail
  of the request's context (between `ngram_min` and `ngram_max` tokens) in its own prompt and
  output, and propose the tokens that followed it.
- `SuffixProposer` (suffix decoding, after Oliaro et al., "SuffixDecoding"): pool the earlier
  occurrences of the context's tail in the request's own tokens and in a bounded store of
  recent outputs of other requests; walk their continuations as a frequency tree (each
  occurrence weighted by how long it matches), following the heaviest branch while the
  draft's empirical probability stays above `min_confidence`, for at most ~1.5x the match
  length tokens. So the 50th agent calling the same tool with a path seen before gets the whole
  call drafted, and a short, ambiguous match drafts little.

A proposer's per-request state follows the request's `all_token_ids` incrementally.
"""

from __future__ import annotations

import math
from collections import Counter

from hearth.config import SpeculativeConfig
from hearth.engine.request import Request
from hearth.engine.speculative.index import SEPARATOR, Candidate, TokenIndex

MAX_MATCH = 64  # longest match length measured (longer matches weigh the same)


class _IndexedProposer:
    """Per-request TokenIndexes, proposals one request at a time."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.indexes: dict[str, TokenIndex] = {}

    def propose(self, req: Request, k: int) -> list[int]:
        raise NotImplementedError

    def propose_many(self, wants: list[tuple[Request, int]]) -> list[list[int]]:
        return [self.propose(req, k) for req, k in wants]

    def drop(self, request_id: str) -> None:
        self.indexes.pop(request_id, None)

    def finished(self, req: Request) -> None:
        self.drop(req.request_id)

    def close(self) -> None:
        pass


class NgramProposer(_IndexedProposer):
    name = "ngram"

    def propose(self, req: Request, k: int) -> list[int]:
        index = self.indexes.get(req.request_id)
        if index is None:
            index = self.indexes[req.request_id] = TokenIndex(self.config.ngram_min)
        tokens = req.all_token_ids
        index.extend_from(tokens)
        found = index.candidates(tokens, 64, self.config.ngram_max, exclude_end=len(tokens) - 1)
        if not found:
            return []
        best = max(found, key=lambda c: c.match_len)  # most recent among the longest (stable)
        return tokens[best.end + 1 : best.end + 1 + k]

class SuffixProposer(_IndexedProposer):
    name = "suffix"

    def __init__(self, config: SpeculativeConfig) -> None:
        super().__init__(config)
        self.key_len = max(2, config.ngram_min)
        self.shared = TokenIndex(self.key_len)  # recent outputs of finished requests
        self.shared.seq = []

    def propose(self, req: Request, k: int) -> list[int]:
        index = self.indexes.get(req.request_id)
        if index is None:
            index = self.indexes[req.request_id] = TokenIndex(self.key_len)
        tokens = req.all_token_ids
        index.extend_from(tokens)
        found = index.candidates(tokens, 32, MAX_MATCH, exclude_end=len(tokens) - 1)
        found += self.shared.candidates(tokens, 32, MAX_MATCH)
        if not found:
            return []
        longest = max(c.match_len for c in found)
        limit = min(k, math.ceil(1.5 * longest))
        return self._walk(found, limit)

    def _walk(self, found: list[Candidate], limit: int) -> list[int]:
        draft: list[int] = []
        active = [(c, float(c.match_len) ** 2) for c in found]
        confidence = 1.0
        for depth in range(1, limit + 1):
            votes: Counter[int] = Counter()
            total = 0.0
            for c, w in active:
                pos = c.end + depth
                if pos < len(c.seq) and c.seq[pos] != SEPARATOR:
                    votes[c.seq[pos]] += w
                    total += w
            if not votes:
                break
            token, weight = votes.most_common(1)[0]
            confidence *= weight / total
            if confidence < self.config.min_confidence:
                break
            draft.append(token)
            active = [(c, w) for c, w in active
                      if c.end + depth < len(c.seq) and c.seq[c.end + depth] == token]
        return draft

    def finished(self, req: Request) -> None:
        self.drop(req.request_id)
        if req.num_output_tokens == 0:
            return
        # The output with a little of the prompt before it, so a match can start in the prompt's
        # tail (a tool-call wrapper, a chat template's assistant header).
        context = req.prompt_token_ids[-16:]
        self.shared.append(context + req.output_token_ids + [SEPARATOR])
        if len(self.shared.seq) > self.config.suffix_global_tokens:
            keep = self.shared.seq[len(self.shared.seq) // 2 :]
            self.shared = TokenIndex(self.key_len)
            self.shared.seq = []
            self.shared.append([SEPARATOR] + keep)

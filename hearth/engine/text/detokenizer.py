"""Streaming token ids -> text deltas that are safe to send, with stop strings.

Invariants (the concatenation of everything `push` and `flush` return is called "the output"):
  * the output equals the decoded text of the pushed ids (decoded after the last few prompt
    tokens, if given), cut at the stop string that completes first (earliest end, the longer
    on a tie), or just after it with include_stop_str_in_output, however the ids are chunked;
  * a delta never ends inside a multi-byte character: a character split across byte-level tokens
    decodes to U+FFFD until complete, and is held back until then (released as-is by `flush`);
  * a delta never contains text that could still turn out to be the start of a stop string;
  * each push costs O(new tokens + the previous push), never O(all tokens).

Window trick (as in vLLM): decode only `ids[prefix_offset:]` and subtract the text of
`ids[prefix_offset:read_offset]`; both offsets always sit on character boundaries.

    ids:  ... | prefix window | new tokens (read_offset ..) |
              ^prefix_offset  ^read_offset
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hearth.engine.text.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
# A UTF-8 character is at most 4 bytes, so a tail still broken after this many tokens is invalid
# for good (the model emitted bad bytes); release it rather than grow the window forever.
MAX_HELD_TOKENS = 8
# Prompt tokens used as decode context: SentencePiece decoders strip the leading space of the
# first token, which is only right at the start of the whole sequence.
NUM_PROMPT_CONTEXT_TOKENS = 4


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        skip_special_tokens: bool = True,
        stop: tuple[str, ...] = (),
        include_stop_str_in_output: bool = False,
        prompt_token_ids: list[int] | tuple[int, ...] = (),
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = tuple(s for s in stop if s)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.stopped_by: str | None = None
        self._ids: list[int] = list(prompt_token_ids[-NUM_PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._held = ""  # decoded text not yet emitted because it may begin a stop string
        self._max_hold = max((len(s) - 1 for s in self.stop), default=0)

    @property
    def finished(self) -> bool:
        return self.stopped_by is not None

    def push(self, token_ids: list[int]) -> str:
        """Add generated tokens; return the text that became safe to emit ('' if none)."""
        if self.stopped_by is not None:
            return ""
        self._ids.extend(token_ids)
        return self._emit(self._decode_new(force=False), final=False)

    def flush(self) -> str:
        """At finish: release everything held back, including a broken trailing character."""
        if self.stopped_by is not None:
            return ""
        return self._emit(self._decode_new(force=True), final=True)

    def _decode_new(self, force: bool) -> str:
        start, read = self._prefix_offset, self._read_offset
        prefix_text = self._decode(self._ids[start:read])
        end = len(self._ids)
        full_text = self._decode(self._ids[start:end])
        if full_text.endswith(REPLACEMENT_CHAR) and not force and end - read < MAX_HELD_TOKENS:
            # The last character is incomplete. Its bytes sit in at most the last 3 tokens:
            # back off to the latest clean cut and hold the tokens after it.
            for cut in range(end - 1, max(read, end - 4), -1):
                text = self._decode(self._ids[start:cut])
                if not text.endswith(REPLACEMENT_CHAR):
                    end, full_text = cut, text
                    break
            else:
                return ""
        self._prefix_offset, self._read_offset = read, end
        return full_text[len(prefix_text) :]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""

    def _emit(self, delta: str, final: bool) -> str:
        if not self.stop:
            return delta
        text = self._held + delta
        match_at, match = _first_match(text, self.stop)
        if match is not None:
            self.stopped_by = match
            self._held = ""
            return text[: match_at + (len(match) if self.include_stop_str_in_output else 0)]
        num_hold = 0 if final else _longest_stop_prefix_suffix(text, self.stop, self._max_hold)
        self._held = text[len(text) - num_hold :] if num_hold else ""
        return text[: len(text) - num_hold]


def _first_match(text: str, stop: tuple[str, ...]) -> tuple[int, str | None]:
    """The stop string that completes first (earliest end; the longer one on a tie), and where
    it starts. Earliest end is when a streaming generation would halt, whatever the chunking."""
    best_end, best_at, best = len(text) + 1, -1, None
    for s in stop:
        at = text.find(s)
        if at == -1:
            continue
        end = at + len(s)
        if end < best_end or (end == best_end and at < best_at):
            best_end, best_at, best = end, at, s
    return best_at, best


def _longest_stop_prefix_suffix(text: str, stop: tuple[str, ...], max_len: int) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    for length in range(min(max_len, len(text)), 0, -1):
        tail = text[-length:]
        if any(s.startswith(tail) for s in stop):
            return length
    return 0

"""A tiktoken-style HF folder — Kimi K2's: `tiktoken.model` + `tokenization_kimi.py`, no
tokenizer.json — as the same byte-level BPE a GGUF of it describes.

Kimi K2 ships its tokenizer as tiktoken mergeable ranks (one `base64(token) rank` line each)
plus remote code that splits text with K2's pattern and appends 256 special-token slots after
the ranks (named by `tokenizer_config.json`'s `added_tokens_decoder`, the rest
`<|reserved_token_{id}|>`). tiktoken merges by rank; a BPE with merges in rank order gives the
same ids once each token's merge is known, which is what llama.cpp's converter recovers: run
tiktoken's merge loop on the token using only the ranks below its own, and the two parts it
ends with are the merge that made it. The result goes through the GGUF tokenizer builder
(hearth/engine/text/gguf_tokenizer.py, pre-tokenizer `kimi-k2`), so both ways to ship K2 tokenize
through one code path. Recovering K2's 163,840 merges takes about a second of CPU at load
(nothing is written into the model folder).

Only Kimi's family is recognised (its `tokenization_kimi.py`, or an `auto_map` naming it):
another tiktoken vocabulary has another split pattern, which hearth would get silently wrong, so
it is refused with a clear error (convert it to a tokenizer.json instead).
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

TIKTOKEN_FILE = "tiktoken.model"
KIMI_SPECIAL_SLOTS = 256  # tokenization_kimi.py's num_reserved_special_tokens
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4  # GGUF token types


def is_tiktoken_folder(folder: Path) -> bool:
    return (folder / TIKTOKEN_FILE).is_file() and not (folder / "tokenizer.json").exists()


def read_ranks(path: Path) -> dict[bytes, int]:
    """tiktoken's mergeable ranks file; ValueError if a line or the rank sequence is malformed."""
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError:
            raise ValueError(f"{path}:{number}: not a 'base64-token rank' line") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: ranks are not 0..{len(ranks) - 1}, each once")
    if any(bytes([b]) not in ranks for b in range(256)):
        raise ValueError(f"{path}: not a byte-level vocabulary (a single byte has no token)")
    return ranks


def byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte-level alphabet (how byte-level vocabularies spell bytes as characters)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


def recover_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The (left, right) merge that made each multi-byte token, in rank order."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) < 2:
            continue
        parts = [token[i:i + 1] for i in range(len(token))]
        while len(parts) > 2:
            best, best_rank = -1, rank
            for i in range(len(parts) - 1):
                r = ranks.get(parts[i] + parts[i + 1])
                if r is not None and r < best_rank:
                    best, best_rank = i, r
            if best < 0:
                break
            parts[best:best + 2] = [parts[best] + parts[best + 1]]
        if len(parts) != 2:
            raise ValueError(f"token of rank {rank} ({token!r}) is not one merge of two lower "
                             f"ranks: not a BPE vocabulary hearth can convert")
        merges.append((parts[0], parts[1]))
    return merges


def _is_kimi(folder: Path, config: dict[str, Any]) -> bool:
    if (folder / "tokenization_kimi.py").is_file():
        return True
    return "tokenization_kimi" in json.dumps(config.get("auto_map", {}))


def tiktoken_folder_metadata(folder: Path, config: dict[str, Any]) -> dict[str, Any]:
    """GGUF-style `tokenizer.*` metadata of a Kimi tiktoken folder (`config`: its
    tokenizer_config.json), for `build_gguf_tokenizer`."""
    if not _is_kimi(folder, config):
        raise ValueError(f"{folder}: a tiktoken vocabulary ({TIKTOKEN_FILE}) of a family hearth "
                         "does not know; hearth reads Kimi K2's (tokenization_kimi.py). Give the "
                         "folder a tokenizer.json (or serve the model's GGUF)")
    ranks = read_ranks(folder / TIKTOKEN_FILE)
    alphabet = byte_level_alphabet()

    def spell(token: bytes) -> str:
        return "".join(alphabet[b] for b in token)

    tokens = [spell(token) for token, _ in sorted(ranks.items(), key=lambda item: item[1])]
    merges = [f"{spell(left)} {spell(right)}" for left, right in recover_merges(ranks)]
    added: dict[int, dict] = {}
    for token_id, entry in (config.get("added_tokens_decoder") or {}).items():
        content = entry.get("content") if isinstance(entry, dict) else entry
        if not isinstance(content, str) or not content:
            raise ValueError(f"{folder}: added_tokens_decoder[{token_id}] has no content")
        added[int(token_id)] = {"content": content,
                                "special": bool(entry.get("special", True))
                                if isinstance(entry, dict) else True}
    num_base = len(tokens)
    if any(i < num_base for i in added):
        raise ValueError(f"{folder}: added_tokens_decoder names id {min(added)}, inside the "
                         f"{num_base} ranks of {TIKTOKEN_FILE}")
    end = max([num_base + KIMI_SPECIAL_SLOTS, *(i + 1 for i in added)])
    types = [_NORMAL] * num_base
    for token_id in range(num_base, end):
        entry = added.get(token_id, {"content": f"<|reserved_token_{token_id}|>", "special": True})
        tokens.append(entry["content"])
        types.append(_CONTROL if entry["special"] else _USER_DEFINED)
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "kimi-k2",
            "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.merges": merges}

"""A copy of the default model whose tokenizer has a tool-call format's markers and whose chat
template (ours, tests/tool_markup.py) writes that format: the model a Kimi K2 or DeepSeek served
by hearth looks like from the server's side, on weights small enough for a test.

The markers are special tokens, as in those models. The model's embedding has no spare rows for
new ids, so the markers take the ids of StarCoder control tokens SmolLM2 never writes in chat
(`<repo_name>`, `<reponame>`, ...). Only the GGUF metadata changes (the token strings and the
chat template); the tensor table and the tensor bytes are copied as they are (their offsets are
relative to the data section, which is realigned).
"""

from __future__ import annotations

import struct
from pathlib import Path

from hearth.config import DEFAULT_MODEL
from hearth.models.gguf_file import DEFAULT_ALIGNMENT, _read_string, _read_value
from hearth.models.loader import resolve_builtin
from tests.tool_markup import MARKERS, chat_template

FIRST_MARKER_ID = 3  # <repo_name>; 0-2 are <|endoftext|>, <|im_start|>, <|im_end|>
_STRING, _ARRAY = 8, 9


def write_marker_model(target: Path, parser: str) -> Path:
    """The default model's GGUF with `parser`'s markers and our template for it, at `target`."""
    return write_model_copy(target, MARKERS[parser], chat_template(parser))


def write_model_copy(target: Path, markers: list[str], template: str) -> Path:
    """The default model's GGUF with `markers` as its special tokens from FIRST_MARKER_ID on
    (none: the vocabulary as it is) and `template` as its chat template, at `target`."""
    source = resolve_builtin(DEFAULT_MODEL)
    buf = memoryview(source.read_bytes())
    _, num_tensors, num_kv = struct.unpack_from("<IQQ", buf, 4)
    pos, entries, metadata = 24, [], {}
    for _ in range(num_kv):
        start = pos
        key, pos = _read_string(buf, pos)
        (value_type,) = struct.unpack_from("<I", buf, pos)
        metadata[key], pos = _read_value(buf, pos + 4, value_type, key, source)
        entries.append((key, bytes(buf[start:pos])))
    table_start = pos
    for _ in range(num_tensors):  # name, n_dims, dims, type, offset
        _, pos = _read_string(buf, pos)
        (num_dims,) = struct.unpack_from("<I", buf, pos)
        pos += 4 + 8 * num_dims + 12
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    data_start = _aligned(pos, alignment)

    tokens = list(metadata["tokenizer.ggml.tokens"])
    taken = tokens[FIRST_MARKER_ID : FIRST_MARKER_ID + len(markers)]
    assert all(t.startswith("<") and t not in ("<|im_start|>", "<|im_end|>") for t in taken), taken
    tokens[FIRST_MARKER_ID : FIRST_MARKER_ID + len(markers)] = markers
    replaced = {"tokenizer.ggml.tokens": _string_array(tokens),
                "tokenizer.chat_template": _string(template)}
    assert not any("\ufffd" in t for t in tokens)  # every token string reads back byte for byte
    kv = b"".join(_raw_string(key) + replaced[key] if key in replaced else raw for key, raw in entries)
    header = buf[:24].tobytes() + kv + buf[table_start:pos].tobytes()
    with open(target, "wb") as out:
        out.write(header + b"\0" * (_aligned(len(header), alignment) - len(header)))
        out.write(buf[data_start:])
    return target


def _aligned(offset: int, alignment: int) -> int:
    return -(-offset // alignment) * alignment


def _string(text: str) -> bytes:
    """A metadata value of type string: its type, then the string itself."""
    return struct.pack("<I", _STRING) + _raw_string(text)


def _string_array(items: list[str]) -> bytes:
    return struct.pack("<IIQ", _ARRAY, _STRING, len(items)) + b"".join(map(_raw_string, items))


def _raw_string(text: str) -> bytes:
    data = text.encode("utf-8")
    return struct.pack("<Q", len(data)) + data

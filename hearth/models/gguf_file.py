"""A GGUF file: its metadata, its tensor table, and zero-copy byte views of its tensor data.

Invariant: opening a file reads only the header (metadata + tensor table); tensor bytes stay in a
private memory map until a caller dequantizes them, and `raw()` never copies.

We parse the header ourselves rather than with `gguf.GGUFReader`: the reader slices a numpy memmap
once per vocabulary string and takes ~2 s on a 49k-token vocabulary, which alone would blow the
cold-start budget. The format is small (all little-endian):

    "GGUF" | u32 version | u64 n_tensors | u64 n_kv
    n_kv  x (string key | u32 value_type | value)           value: scalar | string | array
    n_tensors x (string name | u32 n_dims | u64 dims[n_dims] | u32 ggml_type | u64 offset)
    padding to `general.alignment` (default 32) | tensor data (offsets relative to here)

`dims` are ggml order (fastest-varying first); `GGUFTensorInfo.shape` is torch order (reversed).

`read_metadata(path)` reads the metadata alone, without torch, numpy or gguf: the HTTP process
of a worker builds its tokenizer from it and never imports torch (~1 s of CPU at a cold start,
taken from the engine-core process that loads the model beside it).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types -> struct format (scalars only; 8 = string, 9 = array).
_SCALAR_FORMATS = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d",
}
_FLOAT32, _STRING, _ARRAY = 6, 8, 9
_U64 = struct.Struct("<Q")  # a string's length prefix


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order: shape[-1] is the contiguous (row) dimension
    ggml_type: int  # a gguf.GGMLQuantizationType value
    offset: int  # absolute byte offset of the tensor data in the file
    num_bytes: int


class GGUFFile:
    """The parsed header of one GGUF file plus a copy-on-write mapping of its bytes."""

    def __init__(self, path: str | Path) -> None:
        import torch  # here, not at the top: read_metadata's callers must not pay for it

        self.path = Path(path)
        with open(self.path, "rb") as f:
            # ACCESS_COPY (MAP_PRIVATE): pages are shared with the page cache until written, and
            # torch.frombuffer accepts the buffer as writable, so tensors can view it directly.
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        self.metadata, self.tensors = _parse_header(memoryview(self._map), self.path)

    @property
    def architecture(self) -> str:
        return str(self.metadata["general.architecture"])

    def release(self, name: str | None = None) -> None:
        """Drop this process's pages of a tensor's bytes (None: of the whole file) once they are
        copied elsewhere (repacked blocks, float parameters). The mapping stays valid: a later
        read faults the bytes in again from the page cache or the file (never written, so the
        private mapping has nothing of its own to lose)."""
        if name is None:
            start, end = 0, len(self._map)
        else:
            info = self.tensors[name]
            start, end = info.offset, info.offset + info.num_bytes
        page = mmap.PAGESIZE
        start -= start % page
        end = min(len(self._map), -(-end // page) * page)
        if end > start:
            self._map.madvise(mmap.MADV_DONTNEED, start, end - start)

    def raw(self, name: str) -> torch.Tensor:
        """The tensor's bytes as a uint8 view into the file mapping (no copy)."""
        info = self.tensors[name]
        return self._bytes[info.offset : info.offset + info.num_bytes]


def read_metadata(path: str | Path) -> dict[str, Any]:
    """The metadata of a GGUF file (tokenizer, architecture keys), without its tensor table."""
    path = Path(path)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        view = memoryview(mapped)
        try:
            return _parse_metadata(view, path)[0]
        finally:
            view.release()


def _parse_header(buf: memoryview, path: Path) -> tuple[dict[str, Any], dict[str, GGUFTensorInfo]]:
    metadata, pos, num_tensors = _parse_metadata(buf, path)
    return metadata, _parse_tensors(buf, pos, num_tensors, metadata, path)


def _parse_metadata(buf: memoryview, path: Path) -> tuple[dict[str, Any], int, int]:
    """(metadata, offset of the tensor table, number of tensors)."""
    if bytes(buf[:4]) != GGUF_MAGIC:
        raise ValueError(f"{path} is not a GGUF file (bad magic {bytes(buf[:4])!r})")
    version, num_tensors, num_kv = struct.unpack_from("<IQQ", buf, 4)
    if version not in (2, 3):
        if struct.unpack_from(">I", buf, 4)[0] in (2, 3):
            raise ValueError(f"{path}: big-endian GGUF files are not supported")
        raise ValueError(f"{path}: GGUF version {version} is not supported (need 2 or 3)")
    pos = 24
    metadata: dict[str, Any] = {}
    for _ in range(num_kv):
        key, pos = _read_string(buf, pos)
        (value_type,) = struct.unpack_from("<I", buf, pos)
        metadata[key], pos = _read_value(buf, pos + 4, value_type, key, path)
    return metadata, pos, num_tensors


def _parse_tensors(buf: memoryview, pos: int, num_tensors: int, metadata: dict[str, Any],
                   path: Path) -> dict[str, GGUFTensorInfo]:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    infos: list[tuple[str, tuple[int, ...], int, int]] = []
    for _ in range(num_tensors):
        name, pos = _read_string(buf, pos)
        (num_dims,) = struct.unpack_from("<I", buf, pos)
        dims = struct.unpack_from(f"<{num_dims}Q", buf, pos + 4)
        ggml_type, rel_offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * num_dims)
        pos += 4 + 8 * num_dims + 12
        infos.append((name, tuple(reversed(dims)), ggml_type, rel_offset))

    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    data_start = -(-pos // alignment) * alignment
    tensors: dict[str, GGUFTensorInfo] = {}
    for name, shape, ggml_type, rel_offset in infos:
        try:
            block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
        except (ValueError, KeyError):
            raise ValueError(f"{path}: tensor {name!r} has unknown ggml type {ggml_type}") from None
        num_elements = 1
        for d in shape:
            num_elements *= d
        num_bytes = num_elements // block_size * type_size
        offset = data_start + rel_offset
        if offset + num_bytes > len(buf):
            raise ValueError(f"{path}: tensor {name!r} runs past the end of the file (truncated?)")
        tensors[name] = GGUFTensorInfo(name, shape, ggml_type, offset, num_bytes)
    return tensors


def _read_string(buf: memoryview, pos: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", buf, pos)
    end = pos + 8 + length
    # errors="replace": a few vocabularies hold tokens that are not valid UTF-8 on their own.
    return str(buf[pos + 8 : end], "utf-8", "replace"), end


def _read_value(buf: memoryview, pos: int, value_type: int, key: str, path: Path) -> tuple[Any, int]:
    if value_type in _SCALAR_FORMATS:
        fmt = _SCALAR_FORMATS[value_type]
        value = struct.unpack_from(fmt, buf, pos)[0]
        if value_type == _FLOAT32:
            value = _shortest_float32(value)
        return value, pos + struct.calcsize(fmt)
    if value_type == _STRING:
        return _read_string(buf, pos)
    if value_type == _ARRAY:
        item_type, count = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if item_type in _SCALAR_FORMATS:
            # Token types and scores: one struct call for the whole array.
            code = _SCALAR_FORMATS[item_type][1]
            values = struct.unpack_from(f"<{count}{code}", buf, pos)
            return list(values), pos + struct.calcsize(code) * count
        if item_type == _STRING:  # vocabularies and merge tables: the hot loop of the header
            items, length_at = [], _U64.unpack_from  # inlined _read_string: ~2x faster here
            for _ in range(count):
                (length,) = length_at(buf, pos)
                pos += 8
                items.append(str(buf[pos : pos + length], "utf-8", "replace"))
                pos += length
            return items, pos
        items = []
        for _ in range(count):
            item, pos = _read_value(buf, pos, item_type, key, path)
            items.append(item)
        return items, pos
    raise ValueError(f"{path}: metadata key {key!r} has unknown value type {value_type}")


def _shortest_float32(value: float) -> float:
    """The shortest decimal that is the same float32 (9.99999974e-06 -> 1e-05), as configs write it."""
    packed = struct.pack("<f", value)
    for digits in range(1, 10):
        candidate = float(f"{value:.{digits}g}")
        if struct.pack("<f", candidate) == packed:
            return candidate
    return value

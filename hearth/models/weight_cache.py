"""A GGUF's packed weights in one file under a cache directory (`--weight-cache DIR`), mapped
by every process that loads the same model with the same formats on this host.

`attach_file_blocks` packs a GGUF's blocks into the kernels' layout (PackedWeight); without a
cache each process holds its own packed copy in anonymous memory and pays the repack at every
start. With one, the first load writes each weight's packed tensors into `<sha>.bin` as it packs
them (and drops them), and every load, that one included, then builds its PackedWeights from
views of the file's map: the pages are the page cache's, so a prefill and a decode worker of one
model on one host hold one copy between them, and a restart packs nothing.

    DIR/<sha>.bin    the packed tensors, each 64-byte aligned, in the order the index lists them
    DIR/<sha>.json   the index: FORMAT_VERSION, the key, the .bin's size, and per source (the HF
                     tensors one weight is packed from) its PackedWeights' qtype, features,
                     int8_act and tensors (dtype, shape, offset), or null where the source was
                     not packable
    DIR/<sha>.lock   flock'd around build-or-map: of two workers started together one packs,
                     the other waits and maps its file

<sha> hashes the key: the GGUF's realpath, size and mtime_ns, the activation format (int8_act),
the kernel build (variant, kquant_superblock_act), the layers this model holds, and
FORMAT_VERSION (bump it whenever packing changes what it writes). Both files are written under
temporary names and renamed, the .bin first (fsync'd), so an index names only complete data.
An index or file that does not match (version, key, size, a source it lacks, a tensor past the
end) is ignored with a warning and rebuilt; a directory that cannot be written is a warning and
no cache. The packed bytes are the ones packing makes: a cache never changes results.

The map is opened private (torch.from_file shared=False: MAP_PRIVATE, the file opened read-only):
unwritten pages of a private file mapping are the page cache's own, shared by every process
that maps the file, as with a shared mapping, and a stray write could only copy a page for its
own process, never change the file other workers map.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from hearth.ops.cpu_kernels import QTYPES, PackedWeight

log = logging.getLogger("hearth.models")

FORMAT_VERSION = 1
ALIGN = 64  # each tensor's offset in the .bin (the kernels' rows are read with 64-byte loads)
DTYPES = {"uint8": torch.uint8, "int8": torch.int8, "float16": torch.float16,
          "bfloat16": torch.bfloat16, "float32": torch.float32}

Packed = tuple[PackedWeight, ...] | None  # one source's weights (experts: w13, w2); None: unpacked


@dataclass(frozen=True)
class PackSource:
    """One weight `attach_file_blocks` packs: the HF tensors it comes from (its name in the
    index) and how to pack it (None where the file's blocks are not packable)."""

    sources: tuple[str, ...]
    pack: Callable[[], Packed]


@dataclass(frozen=True)
class CacheLoad:
    """What one load did with the cache (on the model as `weight_cache`, for the log and tests)."""

    path: Path  # the .bin
    hit: bool  # False: this process packed the weights and wrote the file
    num_packed: int  # weights packed by this load (0 on a hit)
    num_bytes: int  # the .bin's size
    seconds: float  # waiting for the lock, packing and writing or validating, mapping
    mapped: torch.Tensor  # [num_bytes] uint8: the map every PackedWeight views


def cache_key(checkpoint, model, int8_act: bool, kernels) -> dict | None:
    """The key of this model's packed weights; None where the checkpoint is not one file."""
    file = getattr(checkpoint, "file", None)
    path = getattr(file, "path", None)
    if path is None:
        return None
    real = os.path.realpath(path)
    stat = os.stat(real)
    return {"format_version": FORMAT_VERSION, "gguf": real, "size": stat.st_size,
            "mtime_ns": stat.st_mtime_ns, "int8_act": int8_act,
            "variant": None if kernels is None else kernels.variant,
            "kquant_superblock_act": kernels is not None and kernels.kquant_superblock_act(),
            "layers": [model.layer_start, len(model.layers)]}


def load_packed(directory: str, key: dict, items: list[PackSource]
                ) -> tuple[dict[tuple[str, ...], Packed], CacheLoad] | None:
    """Every item's packed weights as views of the cache file for `key` (built first where it
    is missing or does not match), and what the load did; None where the directory cannot be
    used (a warning says why: the caller packs as without a cache)."""
    start = time.monotonic()
    folder = Path(directory).expanduser()
    sha = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    bin_path, index_path = folder / f"{sha}.bin", folder / f"{sha}.json"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        lock = open(folder / f"{sha}.lock", "a+b")
    except OSError as e:
        log.warning("weight cache: %s is not usable (%s); packing without a cache", folder, e)
        return None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        index, why = _read_index(index_path, bin_path, key, items)
        num_packed, hit = 0, index is not None
        if not hit:
            if why is not None:
                log.warning("weight cache: %s ignored (%s); rebuilding it", bin_path, why)
            try:
                index, num_packed = _write(bin_path, index_path, key, items)
            except OSError as e:
                log.warning("weight cache: writing %s failed (%s); packing without a cache",
                            bin_path, e)
                return None
        mapped = _map(bin_path, index["size"])
    packed = {tuple(e["sources"]): _views(mapped, e["weights"]) for e in index["entries"]}
    load = CacheLoad(bin_path, hit, num_packed, index["size"],
                     time.monotonic() - start, mapped)
    log.info("weight cache %s: %s, %.2f GB packed weights, %.2f s",
             "hit" if load.hit else "miss (packed and written)", bin_path,
             load.num_bytes / 1e9, load.seconds)
    return packed, load


def _map(path: Path, size: int) -> torch.Tensor:
    if size == 0:  # nothing packable: torch cannot map an empty file
        return torch.empty(0, dtype=torch.uint8)
    return torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)


def _write(bin_path: Path, index_path: Path, key: dict, items: list[PackSource]
           ) -> tuple[dict, int]:
    """Pack each item once, append its tensors to the .bin and drop them (one weight's packed
    copy in memory at a time); then rename the .bin, then the index, into place."""
    for stale in bin_path.parent.glob(f"{bin_path.stem}.*.tmp"):  # a builder that died
        stale.unlink(missing_ok=True)  # (we hold the lock: no other is writing)
    entries, seen, offset = [], set(), 0
    tmp_bin = bin_path.with_name(f"{bin_path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp_bin, "wb") as f:
            for item in items:
                if item.sources in seen:
                    continue
                seen.add(item.sources)
                packed = item.pack()
                weights = None
                if packed is not None:
                    weights = []
                    for w in packed:
                        tensors = []
                        for t in (w.qs, w.d, w.m):
                            offset = _pad(f, offset)
                            raw = t.contiguous().reshape(-1).view(torch.uint8)
                            f.write(raw.numpy())
                            tensors.append({"dtype": str(t.dtype).removeprefix("torch."),
                                            "shape": list(t.shape), "offset": offset})
                            offset += raw.numel()
                        weights.append({"qtype": w.qtype, "out_features": w.out_features,
                                        "in_features": w.in_features, "int8_act": w.int8_act,
                                        "tensors": tensors})
                entries.append({"sources": list(item.sources), "weights": weights})
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_bin, bin_path)
    finally:
        tmp_bin.unlink(missing_ok=True)
    index = {"format_version": FORMAT_VERSION, "key": key, "size": offset, "entries": entries}
    tmp_index = index_path.with_name(f"{index_path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp_index, "w") as f:
            json.dump(index, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_index, index_path)
    finally:
        tmp_index.unlink(missing_ok=True)
    return index, len(seen)


def _pad(f, offset: int) -> int:
    pad = -offset % ALIGN
    if pad:
        f.write(bytes(pad))
    return offset + pad


def _read_index(index_path: Path, bin_path: Path, key: dict, items: list[PackSource]
                ) -> tuple[dict | None, str | None]:
    """(the index, None) where it and the .bin match `key` and cover every item; else (None,
    why), why None where there is no index at all."""
    try:
        index = json.loads(index_path.read_text())
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError) as e:
        return None, f"unreadable index: {e}"
    try:
        if index["format_version"] != FORMAT_VERSION:
            return None, f"format version {index['format_version']}, not {FORMAT_VERSION}"
        if index["key"] != key:
            return None, "its key differs"
        size = index["size"]
        if not bin_path.exists() or bin_path.stat().st_size != size:
            return None, f"{bin_path.name} is not the {size} bytes its index says"
        have = {tuple(e["sources"]) for e in index["entries"]}
        missing = [s for s in (item.sources for item in items) if s not in have]
        if missing:
            return None, f"no entry for {missing[0]}"
        for e in index["entries"]:
            for w in e["weights"] or ():
                if w["qtype"] not in QTYPES or len(w["tensors"]) != 3:
                    return None, f"a bad entry for {e['sources']}"
                for t in w["tensors"]:
                    nbytes = _numel(t["shape"]) * DTYPES[t["dtype"]].itemsize
                    if t["offset"] % ALIGN or t["offset"] < 0 or t["offset"] + nbytes > size:
                        return None, f"a tensor of {e['sources']} outside the file"
    except (KeyError, TypeError, ValueError) as e:
        return None, f"a malformed index ({type(e).__name__}: {e})"
    return index, None


def _numel(shape: list[int]) -> int:
    if not all(isinstance(n, int) and n >= 0 for n in shape):
        raise ValueError(f"shape {shape}")
    out = 1
    for n in shape:
        out *= n
    return out


def _views(mapped: torch.Tensor, weights: list[dict] | None) -> Packed:
    if weights is None:
        return None
    out = []
    for w in weights:
        qs, d, m = (mapped[t["offset"]:t["offset"] + _numel(t["shape"])
                           * DTYPES[t["dtype"]].itemsize].view(DTYPES[t["dtype"]])
                    .view(t["shape"]) for t in w["tensors"])
        out.append(PackedWeight(w["qtype"], qs, d, m, w["out_features"], w["in_features"],
                                w["int8_act"]))
    return tuple(out)

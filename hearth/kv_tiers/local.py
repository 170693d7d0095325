"""The KV tiers of one machine: host memory, and a directory (private or shared by workers).

Each tier holds checked records (hearth/kv_tiers/block_file.py) under block hashes and keeps its
size under a cap, least recently used first. `put` runs on the store's writer thread, `read` on
its loader threads, `contains` on the engine thread (an index lookup, at most one stat).

Invariants:
  * a directory record is found under its final name only complete: it is written to `tmp/` and
    renamed into place (atomic on one filesystem), so a writer killed mid-write leaves a
    temporary file (swept at start) and never a torn record under a block's name;
  * a directory tier rebuilds its index from the files at start (oldest use first), so a
    restarted worker finds its blocks again; a file of the wrong size is dropped then;
  * a record the memory tier pushes out stays readable until the next tier holds it.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections import OrderedDict

import torch

from hearth.kv_tiers.block_file import BlockRecordError, record_bytes
from hearth.engine.kv.transfer_api import KVCacheGeometry

log = logging.getLogger("hearth.kv_tiers.local")

SUFFIX = ".kvb"
STALE_TMP_SECONDS = 60.0  # a temporary file this old has no live writer (swept at start)


def tier_counters() -> dict[str, float]:
    return dict(hits=0, bytes_read=0, stored=0, bytes_written=0, evicted=0, write_errors=0,
                corrupt=0, num_blocks=0, num_bytes=0)


class MemoryTier:
    """Records in host memory (for a pool on a GPU: one PCIe copy away), LRU under a cap."""

    def __init__(self, name: str, max_bytes: int, on_event) -> None:
        self.name = name
        self.max_bytes = max_bytes
        self.on_event = on_event
        self._records: OrderedDict[int, bytes] = OrderedDict()
        self._leaving: dict[int, bytes] = {}  # pushed out, still readable until demoted
        self._lock = threading.Lock()
        self.counters = tier_counters()

    def contains(self, block_hash: int) -> bool:
        return block_hash in self._records or block_hash in self._leaving

    def put(self, block_hash: int, header: bytes, payload: memoryview) -> list[tuple[int, bytes]]:
        """Store; returns the (hash, record) pairs pushed out (for the next tier)."""
        record = bytes(header) + bytes(payload)  # immutable: read without the lock
        out = []
        with self._lock:
            self._records[block_hash] = record
            self._records.move_to_end(block_hash)
            size = self.counters["num_bytes"] + len(record)
            while size > self.max_bytes and len(self._records) > 1:
                old_hash, old = self._records.popitem(last=False)
                size -= len(old)
                out.append((old_hash, old))
                self._leaving[old_hash] = old
            self.counters.update(num_bytes=size, num_blocks=len(self._records))
        self.counters["stored"] += 1
        self.counters["bytes_written"] += len(record)
        self.on_event("stored", block_hash, self.name)
        for old_hash, _ in out:
            self.counters["evicted"] += 1
            self.on_event("evicted", old_hash, self.name)
        return out

    def left(self, block_hash: int) -> None:
        """A pushed-out record is in the next tier now (or was dropped there)."""
        with self._lock:
            self._leaving.pop(block_hash, None)

    def read(self, block_hash: int, buffer: torch.Tensor) -> memoryview:
        with self._lock:
            record = self._records.get(block_hash) or self._leaving.get(block_hash)
            if record is None:
                raise FileNotFoundError(f"block {block_hash:016x} left the {self.name} tier")
            if block_hash in self._records:
                self._records.move_to_end(block_hash)
        view = memoryview(buffer.numpy())[:len(record)]
        view[:] = record  # into the reader's own buffer: the record itself stays immutable
        return view

    def discard(self, block_hash: int) -> None:
        with self._lock:
            record = self._records.pop(block_hash, None)
            self._leaving.pop(block_hash, None)
            if record is not None:
                self.counters["num_bytes"] -= len(record)
                self.counters["num_blocks"] = len(self._records)


class DirectoryTier:
    """One record file per block: `<root>/<namespace>/<first 2 hex>/<hash as 16 hex>.kvb`."""

    def __init__(self, name: str, root: str, namespace: str, max_bytes: int, shared: bool,
                 geometry: KVCacheGeometry, on_event) -> None:
        self.name = name
        self.dir = os.path.join(root, namespace)
        self.tmp_dir = os.path.join(self.dir, "tmp")
        self.max_bytes = max_bytes
        self.shared = shared
        self.record_bytes = record_bytes(geometry)
        self.on_event = on_event
        self._index: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()
        self.counters = tier_counters()
        os.makedirs(self.tmp_dir, exist_ok=True)
        self._rebuild()

    def path(self, block_hash: int) -> str:
        name = f"{block_hash:016x}"
        return os.path.join(self.dir, name[:2], name + SUFFIX)

    def _rebuild(self) -> None:
        """Index the records already here (oldest use first); sweep stale temporary files."""
        now = time.time()
        for entry in os.scandir(self.tmp_dir):
            try:
                if now - entry.stat().st_mtime > STALE_TMP_SECONDS or not self.shared:
                    os.unlink(entry.path)
            except OSError:
                pass
        found = []
        for sub in os.scandir(self.dir):
            if not sub.is_dir() or len(sub.name) != 2:
                continue
            for entry in os.scandir(sub.path):
                if not entry.name.endswith(SUFFIX):
                    continue
                try:
                    block_hash = int(entry.name[:-len(SUFFIX)], 16)
                    st = entry.stat()
                except (ValueError, OSError):
                    continue
                if st.st_size != self.record_bytes:  # cannot be a whole record: drop it
                    _unlink(entry.path)
                    continue
                found.append((st.st_mtime, block_hash))
        for _, block_hash in sorted(found):
            self._index[block_hash] = None
            self.on_event("stored", block_hash, self.name)
        self._set_size()
        self._trim()
        log.info("%s tier %s: %d blocks found", self.name, self.dir, len(self._index))

    def _set_size(self) -> None:
        self.counters["num_blocks"] = len(self._index)
        self.counters["num_bytes"] = len(self._index) * self.record_bytes

    def contains(self, block_hash: int) -> bool:
        if block_hash in self._index:
            return True
        if self.shared and os.path.exists(self.path(block_hash)):  # another worker wrote it
            with self._lock:
                self._index[block_hash] = None
                self._set_size()
            return True
        return False

    def put(self, block_hash: int, header: bytes, payload: memoryview) -> bool:
        """Write one record (writer thread). False when it could not be written."""
        final = self.path(block_hash)
        tmp = os.path.join(self.tmp_dir, f"{block_hash:016x}.{os.getpid()}.{threading.get_ident()}")
        try:
            os.makedirs(os.path.dirname(final), exist_ok=True)
            os.makedirs(self.tmp_dir, exist_ok=True)  # the directory may have been removed
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(tmp, final)
        except OSError as exc:
            _unlink(tmp)
            self.counters["write_errors"] += 1
            if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                self._make_room()  # the disk is fuller than our cap assumed
            log.warning("%s tier: could not write block %016x: %s", self.name, block_hash, exc)
            return False
        with self._lock:
            self._index[block_hash] = None
            self._index.move_to_end(block_hash)
            self._set_size()
        self.counters["stored"] += 1
        self.counters["bytes_written"] += len(header) + len(payload)
        self.on_event("stored", block_hash, self.name)
        self._trim()
        return True

    def _make_room(self) -> None:
        """Disk full: shrink the cap to what fits now and free an eighth of it."""
        with self._lock:
            self.max_bytes = max(self.record_bytes,
                                 min(self.max_bytes, len(self._index) * self.record_bytes * 7 // 8))
        self._trim()

    def _trim(self) -> None:
        while True:
            with self._lock:
                if len(self._index) * self.record_bytes <= self.max_bytes or not self._index:
                    return
                block_hash, _ = self._index.popitem(last=False)
                self._set_size()
            _unlink(self.path(block_hash))
            self.counters["evicted"] += 1
            self.on_event("evicted", block_hash, self.name)

    def read(self, block_hash: int, buffer: torch.Tensor) -> memoryview:
        """The record's bytes, read into `buffer` (uint8, record_bytes long)."""
        view = memoryview(buffer.numpy())
        with open(self.path(block_hash), "rb") as f:
            n = f.readinto(view)
            if f.read(1):
                raise BlockRecordError("file is longer than a record")
        with self._lock:
            if block_hash in self._index:
                self._index.move_to_end(block_hash)
        return view[:n]

    def discard(self, block_hash: int) -> None:
        """A record failed its checks or vanished: forget it (and remove a bad file)."""
        with self._lock:
            self._index.pop(block_hash, None)
            self._set_size()
        _unlink(self.path(block_hash))



def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass

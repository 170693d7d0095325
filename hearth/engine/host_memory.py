"""Host memory: how big CPU buffers are allocated and first touched (Linux/glibc; a no-op elsewhere).

Two costs showed in a profile of a 2k-token prefill on a 2-core VM (2026-12-02), both page faults,
neither arithmetic:

* glibc serves every allocation above its mmap threshold (128 KB to start, raised only after a
  free) with a fresh mmap, so each step's activations (2048 x 3072 fp32 = 25 MB for gate/up) are
  faulted in page by page and unmapped again: a bf16 GEMM whose fp32 copy of the output took
  9.7 ms instead of 2.5 ms. `tune_malloc()` raises the threshold to glibc's maximum (32 MB) and
  keeps freed memory (no trim), so those buffers are reused: fp32 prefill of 2k tokens 1.8 s ->
  1.6 s.
* The KV cache is allocated uninitialized (zeroing costs cold start), so the first prompt written
  into never-used blocks faults every 4 KB page: `rope_write_kv` took 4.8 ms per layer instead of
  0.3. `prefault()` populates the pages from a background thread with MADV_POPULATE_WRITE (Linux
  5.14+), which maps them writable without changing a byte, so it can race the engine's own
  writes safely; ctypes releases the GIL for the call, and it runs in chunks on one core.
"""

from __future__ import annotations

import ctypes
import logging
import sys
import threading

import torch

log = logging.getLogger("hearth.ops")

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_MADV_POPULATE_WRITE = 23
_PAGE = 4096
_CHUNK = 64 << 20
_MMAP_THRESHOLD = 32 << 20  # glibc's upper limit on 64-bit (HEAP_MAX_SIZE / 2)

_tuned = False


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return None


def tune_malloc() -> bool:
    """Keep large freed buffers for reuse instead of returning them to the OS. Idempotent."""
    global _tuned
    if _tuned:
        return True
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    ok = (libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD) == 1
          and libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30) == 1
          and libc.mallopt(_M_TOP_PAD, 64 << 20) == 1)
    _tuned = ok
    return ok


class Prefault(threading.Thread):
    """The background thread `prefault` starts; `stop()` ends it at its next chunk and joins."""

    def __init__(self, madvise, start: int, end: int) -> None:
        super().__init__(name="hearth-prefault", daemon=True)
        self._madvise, self._start, self._end = madvise, start, end
        self._stopping = threading.Event()

    def run(self) -> None:
        for at in range(self._start, self._end, _CHUNK):
            if self._stopping.is_set():
                return
            if self._madvise(at, min(_CHUNK, self._end - at), _MADV_POPULATE_WRITE) != 0:
                log.debug("MADV_POPULATE_WRITE unavailable (errno %d)", ctypes.get_errno())
                return

    def stop(self) -> None:
        self._stopping.set()
        self.join()


def prefault(tensor: torch.Tensor) -> Prefault | None:
    """Populate a CPU tensor's pages in the background, contents untouched. Returns the thread.

    The thread holds the address range, never the tensor: the caller keeps the tensor alive
    (and calls `stop()` before it frees it early). Holding a reference here once made the thread
    free the KV pool at interpreter exit, which released the GIL inside torch's tensor
    destructor; taking it back during finalization ends the thread with a forced unwind through
    a noexcept C++ frame, i.e. std::terminate (SIGABRT after a successful `hearth generate`).
    Should the range be unmapped (or even reused) before the thread ends, MADV_POPULATE_WRITE
    fails or only faults pages in: it never reads or writes their contents.
    """
    libc = _libc()
    if libc is None or tensor.device.type != "cpu" or tensor.nbytes == 0:
        return None
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    addr = tensor.data_ptr()
    start = (addr + _PAGE - 1) // _PAGE * _PAGE
    end = (addr + tensor.nbytes) // _PAGE * _PAGE
    if end <= start:
        return None
    thread = Prefault(madvise, start, end)
    thread.start()
    return thread

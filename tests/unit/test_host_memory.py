"""host_memory: malloc tuning and the KV cache's background first touch (contents untouched)."""

import subprocess
import sys

import pytest
import torch

from hearth.engine import host_memory

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc/Linux only")


@linux
def test_tune_malloc_is_idempotent():
    assert host_memory.tune_malloc()
    assert host_memory.tune_malloc()


@linux
def test_prefault_keeps_written_contents():
    t = torch.empty(3 << 20)  # 12 MB: more than one page, written in part before and during
    t[: 1 << 20] = torch.arange(1 << 20, dtype=torch.float32)
    thread = host_memory.prefault(t)
    assert thread is not None
    t[-5:] = 7.0  # a write racing the populate
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert torch.equal(t[: 1 << 20], torch.arange(1 << 20, dtype=torch.float32))
    assert torch.equal(t[-5:], torch.full((5,), 7.0))


def test_prefault_skips_empty_tensors():
    assert host_memory.prefault(torch.empty(0)) is None


EXIT_WHILE_PREFAULTING = """
import torch
from hearth.engine import host_memory
pool = torch.empty(1 << 30, dtype=torch.uint8)
thread = host_memory.prefault(pool)
assert thread is not None and thread.is_alive()
del pool  # the main thread frees it; the thread only ever held the address range
"""


def test_interpreter_exit_while_prefaulting_is_clean():
    """A prefault thread that held the last reference freed the pool during finalization:
    std::terminate (SIGABRT) after a successful run, ~1 in 10 `hearth generate` calls."""
    if host_memory._libc() is None:
        pytest.skip("no glibc")
    # three tries side by side (each is mostly torch's import on one core)
    tries = [subprocess.Popen([sys.executable, "-c", EXIT_WHILE_PREFAULTING],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(3)]
    try:
        for child in tries:
            _, stderr = child.communicate(timeout=60)
            assert child.returncode == 0, stderr[-2000:]
    finally:
        for child in tries:
            if child.poll() is None:
                child.kill()
                child.wait()


def test_stop_ends_the_thread():
    t = torch.empty(256 << 20, dtype=torch.uint8)
    thread = host_memory.prefault(t)
    if thread is None:
        pytest.skip("no glibc")
    thread.stop()
    assert not thread.is_alive()

"""host_memory: malloc tuning and the KV cache's background first touch (contents untouched)."""

import sys

import pytest
import torch

from hearth.ops import host_memory

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

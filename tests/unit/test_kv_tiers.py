"""KV tiers below the pool, on a small real KV tensor and real directories (no model).

Each test drives the real pieces (BlockPool, KVCacheManager, Scheduler, KVTierDriver,
TieredStore over a directory) and asserts exact block ids, exact bytes and a whole pool; the
failure tests break the store for real: corrupt and truncated files, a removed directory, a
writer process killed with SIGKILL, a full tmpfs, a record that never finishes reading.
"""

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from hearth.config import KVOffloadConfig, SchedulerConfig
from hearth.kv_tiers.block_file import BlockRecordError, check_record, encode_header
from hearth.kv_tiers.store import TieredStore
from hearth.kv_tiers.local import DirectoryTier
from hearth.engine.kv.block_pool import BlockPool
from hearth.engine.kv.transfer_api import KVCacheGeometry
from hearth.engine.kv.cache import KVCacheManager
from hearth.engine.kv.tiers import KVTierDriver
from hearth.engine.request import Request, RequestStatus
from hearth.engine.sampling_params import SamplingParams
from hearth.engine.scheduler import Scheduler

BS = 4
NS = "0123456789abcdef"
GEOMETRY = KVCacheGeometry(num_layers=2, num_blocks=8, block_size=BS, num_kv_heads=2,
                           head_dim=8, dtype="float32")


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Rig:
    """A scheduler over an 8-block pool whose KV tensor is real and whose tiers are `config`."""

    def __init__(self, config: KVOffloadConfig, num_blocks: int = 8, seed: int = 0) -> None:
        g = GEOMETRY
        self.kv_cache = torch.zeros(g.num_layers, 2, num_blocks, BS, g.num_kv_heads, g.head_dim)
        self.geometry = KVCacheGeometry(g.num_layers, num_blocks, BS, g.num_kv_heads,
                                        g.head_dim, "float32")
        self.pool = BlockPool(num_blocks)
        self.kv = KVCacheManager(self.pool, BS)
        self.scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=4096, max_num_seqs=8),
                                   self.kv, max_model_len=1024)
        self.store = TieredStore(config, self.kv_cache, self.geometry, NS)
        self.clock = FakeClock()
        self.driver = KVTierDriver(self.store, self.scheduler, self.kv, 5.0,
                                   write_through=config.write_through, clock=self.clock)
        self.gen = torch.Generator().manual_seed(seed)

    def compute(self, req: Request) -> None:
        """Stand-in for the model: write distinct values into the computed blocks' KV."""
        for i, block_id in enumerate(req.block_ids):
            if i * BS >= req.num_computed_tokens:
                self.kv_cache[:, :, block_id] = block_value(req.block_hashes[i]
                                                            if i < len(req.block_hashes) else i)

    def run_prompt(self, rid: str, tokens: list[int]) -> Request:
        """Admit, load what the tiers hold, compute the rest, register and finish."""
        req = Request(rid, tokens, SamplingParams(max_tokens=4))
        self.scheduler.add(req)
        out = self.scheduler.schedule()
        self.driver.start_loads(out.kv_loads)
        self.wait_loads()
        if req.status == RequestStatus.WAITING_FOR_KV:
            raise AssertionError("load did not complete")
        if req.num_computed_tokens < req.num_tokens:
            if req not in [r for r, _ in out.scheduled]:  # it waited for a load first
                out = self.scheduler.schedule()
            assert [r for r, _ in out.scheduled] == [req]
            self.compute(req)
            req.num_computed_tokens = req.num_tokens
            self.kv.register_computed_blocks(req)
        self.last_block_ids = list(req.block_ids)
        self.scheduler.finish(req, RequestStatus.FINISHED_LENGTH)
        return req

    def wait_loads(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while self.driver.num_loading and time.monotonic() < deadline:
            self.driver.wait(0.05)
            self.driver.poll()
        self.driver.poll()

    def flush(self) -> None:
        """Wait until every staged block is written."""
        deadline = time.monotonic() + 10
        while self.store.counters["queue_depth"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert self.store.counters["queue_depth"] == 0

    def close(self) -> None:
        self.store.close()


def block_value(seed: int) -> torch.Tensor:
    g = GEOMETRY
    gen = torch.Generator().manual_seed(seed & 0x7FFFFFFF)
    return torch.randn(g.num_layers, 2, BS, g.num_kv_heads, g.head_dim, generator=gen)


def disk(tmp_path, **kw) -> KVOffloadConfig:
    return KVOffloadConfig(directory=str(tmp_path / "kv"), **kw)


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def fill_and_evict(rig: Rig, prompt: list[int]) -> Request:
    """Compute `prompt`, then push its blocks out of the pool with unrelated prompts."""
    req = rig.run_prompt("a", prompt)
    for k in range(2):
        rig.run_prompt(f"evict{k}", tokens(4 * BS + 1, start=1000 + 100 * k))
    rig.flush()
    rig.driver.poll()
    return req


def test_evicted_blocks_are_written_and_loaded_back_instead_of_recomputed(tmp_path):
    rig = Rig(disk(tmp_path))
    prompt = tokens(3 * BS + 2)  # 3 full blocks + 2 tokens
    first = fill_and_evict(rig, prompt)
    hashes = first.block_hashes[:3]
    assert all(rig.store.contains(h) for h in hashes)
    assert all(rig.pool.get_cached(h) is None for h in hashes)  # gone from the pool
    again = Request("b", prompt, SamplingParams(max_tokens=4))
    rig.scheduler.add(again)
    out = rig.scheduler.schedule()
    assert out.kv_loads == [again] and out.scheduled == [] and out.num_batched_tokens == 0
    assert again.status == RequestStatus.WAITING_FOR_KV and len(again.block_ids) == 3
    rig.driver.start_loads(out.kv_loads)
    rig.wait_loads()
    assert again.status == RequestStatus.RUNNING and again.num_computed_tokens == 3 * BS
    assert again.num_cached_tokens == 3 * BS  # tokens from every tier count as cached
    for i, h in enumerate(hashes):
        assert torch.equal(rig.kv_cache[:, :, again.block_ids[i]], block_value(h))
        assert rig.pool.get_cached(h).block_id == again.block_ids[i]  # re-registered
    stats = rig.driver.stats()
    assert stats["disk"]["hits"] == 3 and stats["offload"]["load_blocks"] == 3
    out = rig.scheduler.schedule()
    assert [(r.request_id, n) for r, n in out.scheduled] == [("b", 2)]  # only the tail
    rig.scheduler.finish(again, RequestStatus.FINISHED_LENGTH)
    rig.pool.check_integrity()
    assert rig.pool.is_whole()
    rig.close()


def test_pool_hits_come_first_then_the_tier_continues_the_prefix(tmp_path):
    rig = Rig(disk(tmp_path))
    prompt = tokens(3 * BS + 1)
    fill_and_evict(rig, prompt)
    rig.run_prompt("warm", tokens(BS + 1))  # block 0 of the prompt is back in the pool
    hashes = rig.kv.update_block_hashes(Request("x", prompt, SamplingParams()))
    head = rig.pool.get_cached(hashes[0])
    assert head is not None and rig.pool.get_cached(hashes[1]) is None
    hits_before = rig.driver.stats()["disk"]["hits"]  # "warm" itself loaded block 0
    req = Request("b", prompt, SamplingParams(max_tokens=4))
    rig.scheduler.add(req)
    out = rig.scheduler.schedule()
    assert out.kv_loads == [req] and req.block_ids[0] == head.block_id
    assert req.num_computed_tokens == BS and len(req.block_ids) == 3
    rig.driver.start_loads(out.kv_loads)
    rig.wait_loads()
    assert req.num_computed_tokens == 3 * BS and req.num_cached_tokens == 3 * BS
    assert rig.driver.stats()["disk"]["hits"] - hits_before == 2  # only what the pool lacked
    rig.scheduler.finish(req, RequestStatus.FINISHED_LENGTH)
    assert rig.pool.is_whole()
    rig.close()


def test_a_restarted_store_rebuilds_its_index_from_the_directory(tmp_path):
    rig = Rig(disk(tmp_path))
    prompt = tokens(3 * BS + 1)
    first = fill_and_evict(rig, prompt)
    rig.close()
    rig2 = Rig(disk(tmp_path))  # a new process would see exactly this
    assert all(rig2.store.contains(h) for h in first.block_hashes[:3])
    assert rig2.store.stats()["disk"]["num_blocks"] >= 3
    assert rig2.pool.tier_events_since(0) == {}  # the store's events reach the pool on poll
    rig2.driver.poll()
    stored, _ = rig2.pool.tier_events_since(0)["disk"]
    assert set(first.block_hashes[:3]) <= set(stored)  # the router learns them at start
    req = rig2.run_prompt("b", prompt)
    assert req.num_cached_tokens == 3 * BS
    assert rig2.pool.is_whole()
    rig2.close()


def test_corrupt_bytes_are_never_loaded_and_the_rest_is_recomputed(tmp_path):
    rig = Rig(disk(tmp_path))
    prompt = tokens(3 * BS + 1)
    first = fill_and_evict(rig, prompt)
    tier = rig.store.tiers[0]
    bad = tier.path(first.block_hashes[1])
    with open(bad, "r+b") as f:
        f.seek(-7, os.SEEK_END)
        byte = f.read(1)
        f.seek(-7, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0x40]))
    req = rig.run_prompt("b", prompt)
    assert req.num_cached_tokens == BS  # block 0 loaded, block 1 rejected: 1 and 2 recomputed
    stats = rig.driver.stats()
    assert stats["disk"]["corrupt"] == 1 and stats["offload"]["load_failures"] == 1
    assert not os.path.exists(bad) and not rig.store.contains(first.block_hashes[1])
    assert torch.equal(rig.kv_cache[:, :, rig.last_block_ids[0]],
                       block_value(first.block_hashes[0]))
    rig.pool.check_integrity()
    assert rig.pool.is_whole()
    rig.close()


def test_record_checks_reject_every_mismatch():
    payload = memoryview(bytearray(os.urandom(GEOMETRY.bytes_per_block)))
    record = bytearray(encode_header(NS, 7, GEOMETRY, payload) + bytes(payload))
    assert bytes(check_record(memoryview(record), NS, 7, GEOMETRY)) == bytes(payload)
    cases = {
        "hash": (memoryview(record), NS, 8, GEOMETRY),
        "namespace": (memoryview(record), "fedcba9876543210", 7, GEOMETRY),
        "layout": (memoryview(record), NS, 7, KVCacheGeometry(2, 8, BS, 2, 8, "bfloat16")),
        "torn": (memoryview(record)[:-1], NS, 7, GEOMETRY),
        "header": (memoryview(record)[:10], NS, 7, GEOMETRY),
    }
    for what, args in cases.items():
        with pytest.raises(BlockRecordError):
            check_record(*args)
    record[-1] ^= 1
    with pytest.raises(BlockRecordError, match="checksum"):
        check_record(memoryview(record), NS, 7, GEOMETRY)


def test_a_truncated_record_is_dropped_at_start_and_never_indexed(tmp_path):
    rig = Rig(disk(tmp_path))
    first = fill_and_evict(rig, tokens(3 * BS + 1))
    path = rig.store.tiers[0].path(first.block_hashes[0])
    rig.close()
    with open(path, "r+b") as f:
        f.truncate(100)
    rig2 = Rig(disk(tmp_path))
    assert not rig2.store.contains(first.block_hashes[0]) and not os.path.exists(path)
    assert rig2.store.contains(first.block_hashes[1])
    req = rig2.run_prompt("b", tokens(3 * BS + 1))
    assert req.num_cached_tokens == 0  # the prefix starts with the missing block
    assert rig2.pool.is_whole()
    rig2.close()


def test_store_removed_mid_request_degrades_to_recompute(tmp_path):
    rig = Rig(disk(tmp_path))
    prompt = tokens(3 * BS + 1)
    fill_and_evict(rig, prompt)
    req = Request("b", prompt, SamplingParams(max_tokens=4))
    rig.scheduler.add(req)
    out = rig.scheduler.schedule()
    assert out.kv_loads == [req]  # the lookup saw the blocks ...
    rig.flush()  # (the admission's own evictions are being written)
    shutil.rmtree(tmp_path / "kv")  # ... then the store goes away before they are read
    rig.driver.start_loads(out.kv_loads)
    rig.wait_loads()
    assert req.status == RequestStatus.RUNNING and req.num_computed_tokens == 0
    assert rig.driver.stats()["offload"]["load_failures"] == 1
    out = rig.scheduler.schedule()
    assert [(r.request_id, n) for r, n in out.scheduled] == [("b", 3 * BS + 1)]
    rig.scheduler.finish(req, RequestStatus.FINISHED_LENGTH)
    # later evictions recreate the directory and keep working
    rig.run_prompt("c", tokens(4 * BS + 1, start=5000))
    rig.run_prompt("d", tokens(4 * BS + 1, start=6000))
    rig.flush()
    assert rig.store.stats()["disk"]["stored"] > 0
    assert rig.pool.is_whole()
    rig.close()


def test_a_load_that_hangs_is_cancelled_at_its_deadline(tmp_path):
    rig = Rig(disk(tmp_path))
    prompt = tokens(3 * BS + 1)
    first = fill_and_evict(rig, prompt)
    path = rig.store.tiers[0].path(first.block_hashes[0])
    os.unlink(path)
    os.mkfifo(path)  # opening it for reading blocks until a writer comes: a hung store
    req = Request("b", prompt, SamplingParams(max_tokens=4))
    rig.scheduler.add(req)
    out = rig.scheduler.schedule()
    rig.driver.start_loads(out.kv_loads)
    rig.driver.poll()
    assert req.status == RequestStatus.WAITING_FOR_KV
    rig.clock.now += 5.0  # the load deadline passes
    rig.driver.poll()
    assert req.status == RequestStatus.RUNNING and req.num_computed_tokens == 0
    assert rig.driver.counters["load_timeouts"] == 1
    rig.scheduler.finish(req, RequestStatus.FINISHED_LENGTH)
    with open(path, "wb"):
        pass  # unblock the stuck reader: it reads nothing, and its late result is dropped
    deadline = time.monotonic() + 30  # until the late result has been taken and dropped
    while not rig.pool.is_whole() and time.monotonic() < deadline:
        rig.driver.poll()
        time.sleep(0.01)
    assert rig.pool.is_whole() and req.num_cached_tokens == 0
    rig.close()


def test_an_aborted_loading_request_frees_its_blocks_when_the_load_ends(tmp_path):
    rig = Rig(disk(tmp_path))
    prompt = tokens(3 * BS + 1)
    fill_and_evict(rig, prompt)
    req = Request("b", prompt, SamplingParams(max_tokens=4))
    rig.scheduler.add(req)
    out = rig.scheduler.schedule()
    rig.driver.start_loads(out.kv_loads)
    rig.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)  # while loading
    assert not rig.pool.is_whole()  # the load may still write its blocks
    rig.wait_loads()
    rig.pool.check_integrity()
    assert rig.pool.is_whole() and rig.scheduler.num_unfinished == 0
    rig.close()


def test_size_cap_evicts_least_recently_used_files(tmp_path):
    record = 68 + GEOMETRY.bytes_per_block
    rig = Rig(disk(tmp_path, max_gb=3 * record / 2**30))
    fill_and_evict(rig, tokens(3 * BS + 1))
    tier = rig.store.tiers[0]
    rig.driver.poll()
    stored, evicted = rig.pool.tier_events_since(0)["disk"]
    assert len(stored) == 4 and evicted == stored[:1]  # the oldest went first
    assert tier.counters["num_blocks"] == 3 and list(tier._index) == stored[1:]
    files = sorted(f for _, _, fs in os.walk(tier.dir) for f in fs if f.endswith(".kvb"))
    assert files == sorted(f"{h:016x}.kvb" for h in stored[1:])
    rig.close()


def test_host_tier_demotes_to_disk_when_full(tmp_path):
    record = 68 + GEOMETRY.bytes_per_block
    rig = Rig(KVOffloadConfig(directory=str(tmp_path / "kv"), host_gb=2 * record / 2**30))
    prompt = tokens(3 * BS + 1)
    first = fill_and_evict(rig, prompt)
    host, disk_tier = rig.store.tiers
    # evicted tail first (blocks 2, 1, 0 of the prompt, then one of "evict0"): the host keeps
    # the last two, the first two were demoted to the disk
    assert host.counters["num_blocks"] == 2 and disk_tier.counters["stored"] == 2
    assert list(host._records)[0] == first.block_hashes[0]
    assert list(disk_tier._index) == [first.block_hashes[2], first.block_hashes[1]]
    req = Request("b", prompt, SamplingParams(max_tokens=4))
    rig.scheduler.add(req)
    out = rig.scheduler.schedule()
    # the load's own allocation evicted two of "evict1"'s blocks into the host tier, which
    # demotes block 0 too: once written, all three come back from the disk
    rig.flush()
    assert all(h in disk_tier._index and h not in host._records for h in first.block_hashes[:3])
    rig.driver.start_loads(out.kv_loads)
    rig.wait_loads()
    assert req.num_computed_tokens == 3 * BS and req.num_cached_tokens == 3 * BS
    assert (host.counters["hits"], disk_tier.counters["hits"]) == (0, 3)
    rig.scheduler.finish(req, RequestStatus.FINISHED_LENGTH)
    assert rig.pool.is_whole()
    rig.close()


def test_two_workers_share_one_directory(tmp_path):
    shared = KVOffloadConfig(directory=str(tmp_path / "kv"), shared=True)
    a, b = Rig(shared), Rig(shared)
    prompt = tokens(3 * BS + 1)
    first = fill_and_evict(a, prompt)
    assert b.store.tier_names == ("shared",)
    req = b.run_prompt("b", prompt)  # b never computed it: a's evictions serve it
    assert req.num_cached_tokens == 3 * BS and b.driver.stats()["shared"]["hits"] == 3
    for i, h in enumerate(first.block_hashes[:3]):
        assert torch.equal(b.kv_cache[:, :, b.last_block_ids[i]], block_value(h))
    assert b.pool.is_whole()
    a.close()
    b.close()


def test_a_shared_tier_is_written_through_before_any_eviction(tmp_path):
    shared = KVOffloadConfig(directory=str(tmp_path / "kv"), shared=True)
    a, b = Rig(shared), Rig(shared)
    prompt = tokens(3 * BS + 1)
    first = a.run_prompt("a", prompt)
    a.flush()
    assert all(a.pool.get_cached(h) is not None for h in first.block_hashes[:3])  # still pooled
    req = b.run_prompt("b", prompt)
    assert req.num_cached_tokens == 3 * BS and b.driver.stats()["shared"]["hits"] == 3
    a.run_prompt("evict", tokens(7 * BS + 1, start=1000))  # now a evicts them: already stored
    assert a.driver.counters["offload_skipped"] >= 3
    assert a.pool.is_whole() and b.pool.is_whole()
    a.close()
    b.close()


def test_offload_drops_instead_of_blocking_when_staging_is_full(tmp_path):
    rig = Rig(disk(tmp_path, max_pending_blocks=1))
    gate = threading.Lock()
    gate.acquire()
    tier = rig.store.tiers[0]
    real_put = tier.put

    def slow_put(*args):  # a disk that stalls (the engine thread must not wait for it)
        with gate:
            return real_put(*args)
    tier.put = slow_put
    for block_id in range(8):
        rig.kv_cache[:, :, block_id] = block_value(block_id)
    # one buffer kept, a burst borrows up to 4 in flight; past that, evictions are dropped
    assert [rig.store.offload(h, h % 8) for h in range(1, 6)] == [True] * 4 + [False]
    assert rig.store.counters["writes_dropped"] == 1
    assert all(rig.store.contains(h) for h in range(1, 5))  # pending writes count as held
    gate.release()
    rig.flush()
    assert all(rig.store.contains(h) for h in range(1, 5)) and not rig.store.contains(5)
    assert rig.store._free_staging.qsize() == 1  # borrowed buffers were let go
    buf = torch.empty(68 + GEOMETRY.bytes_per_block, dtype=torch.uint8)
    for h in range(1, 5):  # borrowed or kept, each buffer held its own block until written
        payload = check_record(rig.store.tiers[0].read(h, buf), NS, h, rig.geometry)
        assert bytes(payload) == rig.kv_cache[:, :, h % 8].contiguous().view(-1).view(
            torch.uint8).numpy().tobytes()
    rig.close()


WRITER = textwrap.dedent("""
    import sys, torch
    from hearth.kv_tiers.block_file import encode_header
    from hearth.kv_tiers.local import DirectoryTier
    from hearth.engine.kv.transfer_api import KVCacheGeometry
    g = KVCacheGeometry(32, 4, 16, 8, 64, "float32")  # 2 MiB blocks: writes take a while
    ns = "0123456789abcdef"
    tier = DirectoryTier("disk", sys.argv[1], ns, 2**40, False, g, lambda *a: None)
    payload = memoryview(torch.randn(g.bytes_per_block // 4).view(torch.uint8).numpy())
    print("ready", flush=True)
    h = int(sys.argv[2])
    while True:  # the writer thread's loop, back to back
        tier.put(h, encode_header(ns, h, g, payload), payload)
        h += 1
""")


def renamed_records(ns_dir: str) -> list[str]:
    """Records under their final names (only a finished write is renamed there)."""
    return [name for sub in os.listdir(ns_dir) if sub != "tmp"
            for name in os.listdir(os.path.join(ns_dir, sub))]


def test_a_writer_killed_mid_write_leaves_no_torn_record(tmp_path):
    """SIGKILL a process that writes records back to back; a restart finds only whole records
    (the killed write's temporary file is swept). Repeated until a kill lands mid-write."""
    root = str(tmp_path / "kv")
    ns_dir = os.path.join(root, NS)
    g = KVCacheGeometry(32, 4, 16, 8, 64, "float32")
    buf = torch.empty(68 + g.bytes_per_block, dtype=torch.uint8)
    caught_mid_write = 0
    for attempt in range(10):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, root, str(1 + 10**6 * attempt)],
                                stdout=subprocess.PIPE)
        assert proc.stdout.readline().strip() == b"ready"
        # kill once a record is whole and the next one is being written (it may still finish
        # before the signal lands: hence the attempts)
        deadline = time.monotonic() + 10
        while not (renamed_records(ns_dir) and os.listdir(os.path.join(ns_dir, "tmp"))) \
                and time.monotonic() < deadline:
            time.sleep(0.001)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        caught_mid_write += bool(os.listdir(os.path.join(ns_dir, "tmp")))
        tier = DirectoryTier("disk", root, NS, 2**40, False, g, lambda *a: None)
        assert not os.listdir(os.path.join(ns_dir, "tmp"))  # the restart swept partial files
        assert tier.counters["num_blocks"] > 0
        for block_hash in list(tier._index):
            check_record(tier.read(block_hash, buf), NS, block_hash, g)  # every record whole
        if caught_mid_write:
            break
    assert caught_mid_write, "no kill landed mid-write in 10 attempts"


@pytest.fixture
def tiny_tmpfs(tmp_path):
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)],
                       capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=False)


def test_a_full_disk_degrades_to_fewer_blocks_never_an_error(tiny_tmpfs):
    rig = Rig(KVOffloadConfig(directory=str(tiny_tmpfs), max_gb=1.0), num_blocks=64)
    for k in range(12):  # ~1 KiB records, far past 64 KiB
        rig.run_prompt(f"r{k}", tokens(15 * BS + 1, start=100 * k))
    rig.run_prompt("evict", tokens(60 * BS + 1, start=90000))
    rig.flush()
    tier = rig.store.tiers[0]
    assert tier.counters["write_errors"] > 0  # ENOSPC happened ...
    assert tier.max_bytes < 64 * 1024  # ... and the cap shrank to what the disk holds
    buf = torch.empty(68 + GEOMETRY.bytes_per_block, dtype=torch.uint8)
    for block_hash in list(tier._index):
        check_record(tier.read(block_hash, buf), NS, block_hash, rig.geometry)
    assert not os.listdir(tier.tmp_dir)  # failed writes left nothing behind
    rig.run_prompt("after", tokens(15 * BS + 1, start=0))  # still serves, loads what is there
    assert rig.pool.is_whole()
    rig.close()


# ---- prefetch: a waiting request's tier blocks read ahead into host memory -------------------
def queue(rig: Rig, rid: str, prompt: list[int]) -> Request:
    """Add a request and run the driver's poll as a step would before scheduling (its tier
    blocks start being read ahead)."""
    req = Request(rid, prompt, SamplingParams(max_tokens=4))
    rig.scheduler.add(req)
    rig.driver.poll()
    return req


def wait_until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert condition()


def finish_and_check_whole(rig: Rig, req: Request) -> None:
    rig.scheduler.finish(req, RequestStatus.FINISHED_LENGTH)
    rig.wait_loads()  # also polls: what was read ahead for it is released
    assert rig.store.num_prefetched == 0 and rig.driver.prefetching == {}
    rig.pool.check_integrity()
    assert rig.pool.is_whole() and rig.scheduler.num_unfinished == 0


def test_read_ahead_blocks_are_copied_in_at_admission_and_it_runs_in_that_step(tmp_path):
    rig = Rig(disk(tmp_path))
    prompt = tokens(3 * BS + 1)
    first = fill_and_evict(rig, prompt)
    hashes = first.block_hashes[:3]
    req = queue(rig, "b", prompt)
    assert rig.store.num_prefetched == 3
    wait_until(lambda: rig.store.ready(hashes) == 3)
    out = rig.scheduler.schedule()
    # no load, no WAITING_FOR_KV: it computes its last token in this very step
    assert out.kv_loads == [] and out.scheduled == [(req, 1)]
    assert req.status == RequestStatus.RUNNING and req.num_computed_tokens == 3 * BS
    assert req.num_cached_tokens == 3 * BS
    for i in range(3):
        assert torch.equal(rig.kv_cache[:, :, req.block_ids[i]], block_value(hashes[i]))
    assert rig.store.num_prefetched == 0  # taken by the fill
    c = rig.driver.stats()["offload"]
    assert (c["fills"], c["loads"], c["load_blocks"], c["prefetched"], c["prefetch_used"]) == \
        (1, 0, 3, 3, 3)
    assert rig.store.stats()["disk"]["hits"] == 3
    finish_and_check_whole(rig, req)
    rig.close()


def hang_record(rig: Rig, block_hash: int) -> tuple[str, bytes]:
    """Replace a record by a FIFO: reading it blocks until someone writes. Returns (path, the
    record's bytes)."""
    path = rig.store.tiers[0].path(block_hash)
    with open(path, "rb") as f:
        record = f.read()
    os.unlink(path)
    os.mkfifo(path)
    return path, record


def test_a_load_waits_for_the_reads_already_in_flight_instead_of_reading_again(tmp_path):
    rig = Rig(disk(tmp_path))
    prompt = tokens(3 * BS + 1)
    first = fill_and_evict(rig, prompt)
    path, record = hang_record(rig, first.block_hashes[0])
    req = queue(rig, "b", prompt)  # block 0's read hangs in a prefetch thread
    out = rig.scheduler.schedule()
    assert out.kv_loads == [req]  # not all read yet: the load path, which takes the reads over
    rig.driver.start_loads(out.kv_loads)
    assert rig.store.num_prefetched == 0 and rig.store.counters["prefetch_used"] == 3
    with open(path, "wb") as f:
        f.write(record)  # the hung read gets the true record: the load goes on with it
    rig.wait_loads()
    assert req.status == RequestStatus.RUNNING and req.num_computed_tokens == 3 * BS
    for i in range(3):
        assert torch.equal(rig.kv_cache[:, :, req.block_ids[i]],
                           block_value(first.block_hashes[i]))
    assert rig.store.stats()["disk"]["hits"] == 3  # each block read once
    finish_and_check_whole(rig, req)
    rig.close()


def test_a_request_aborted_while_its_blocks_are_read_ahead_releases_them(tmp_path):
    rig = Rig(disk(tmp_path))
    prompt = tokens(3 * BS + 1)
    first = fill_and_evict(rig, prompt)
    before = rig.kv_cache.clone()
    path, record = hang_record(rig, first.block_hashes[0])
    req = queue(rig, "b", prompt)  # block 0's read hangs mid-prefetch
    assert rig.store.num_prefetched == 3 and list(rig.driver.prefetching) == ["b"]
    rig.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)  # before it was ever admitted
    rig.driver.poll()
    assert rig.store.num_prefetched == 0 and rig.driver.prefetching == {}
    assert rig.store.counters["prefetch_unused"] == 3
    with open(path, "wb") as f:
        f.write(record)  # the hung read ends; nothing takes its bytes
    assert torch.equal(rig.kv_cache, before)  # a read ahead never writes the pool
    rig.pool.check_integrity()
    assert rig.pool.is_whole() and rig.scheduler.num_unfinished == 0
    rig.close()


@pytest.mark.parametrize("damage", ["corrupt", "missing"])
def test_a_bad_record_met_while_reading_ahead_is_recomputed(tmp_path, damage):
    rig = Rig(disk(tmp_path))
    prompt = tokens(3 * BS + 1)
    first = fill_and_evict(rig, prompt)
    bad = rig.store.tiers[0].path(first.block_hashes[1])
    if damage == "corrupt":
        with open(bad, "r+b") as f:
            f.seek(-7, os.SEEK_END)
            byte = f.read(1)
            f.seek(-7, os.SEEK_END)
            f.write(bytes([byte[0] ^ 0x40]))
    else:
        os.unlink(bad)  # vanished behind the index's back (another worker, an operator)
    req = queue(rig, "b", prompt)
    assert rig.store.num_prefetched == 3
    wait_until(lambda: not rig.store.contains(first.block_hashes[1]))  # the read dropped it
    wait_until(lambda: rig.store.ready(first.block_hashes[:1]) == 1)
    out = rig.scheduler.schedule()
    # block 0 copied in from memory, blocks 1 and 2 (and the last token) computed
    assert out.kv_loads == [] and out.scheduled == [(req, 2 * BS + 1)]
    assert req.num_computed_tokens == BS and req.num_cached_tokens == BS
    assert torch.equal(rig.kv_cache[:, :, req.block_ids[0]], block_value(first.block_hashes[0]))
    assert rig.store.stats()["disk"]["corrupt"] == (damage == "corrupt")
    assert not os.path.exists(bad)
    finish_and_check_whole(rig, req)  # block 2's read-ahead is let go
    assert rig.store.counters["prefetch_unused"] == 2  # blocks 1 (failed) and 2
    rig.close()

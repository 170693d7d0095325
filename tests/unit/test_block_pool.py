"""Block pool and prefix cache: exact block ids, eviction order, integrity after every cycle."""

import pytest

from hearth.engine.kv.block_hash import hash_block, hash_blocks
from hearth.engine.kv.block_pool import BlockPool
from hearth.engine.kv.cache import KVCacheManager
from hearth.engine.request import Request
from hearth.engine.sampling_params import SamplingParams

BS = 4


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4))


def make_manager(num_blocks: int = 8) -> KVCacheManager:
    return KVCacheManager(BlockPool(num_blocks), BS)


def run_prefill(kv: KVCacheManager, req: Request) -> list:
    hits = kv.find_cached_prefix(req)
    num_new = req.num_tokens - len(hits) * BS
    assert kv.allocate(req, num_new, hits)
    req.num_computed_tokens += num_new
    kv.register_computed_blocks(req)
    return hits


def test_allocation_order_and_free_queue_order():
    pool = BlockPool(6)
    a = pool.allocate(2)
    b = pool.allocate(3)
    assert [x.block_id for x in a] == [0, 1]
    assert [x.block_id for x in b] == [2, 3, 4]
    assert list(pool.free_queue) == [5]
    pool.free(list(reversed(b)))  # tail first: 4 is evicted before 3 before 2
    assert list(pool.free_queue) == [5, 4, 3, 2]
    pool.free(list(reversed(a)))
    assert list(pool.free_queue) == [5, 4, 3, 2, 1, 0]
    assert pool.is_whole()
    pool.check_integrity()


def test_hash_is_chained_and_stable():
    h1 = hash_blocks([1, 2, 3, 4, 5, 6, 7, 8, 9], BS)
    assert len(h1) == 2
    assert h1[0] == hash_block(0, [1, 2, 3, 4])
    assert h1[1] == hash_block(h1[0], [5, 6, 7, 8])
    # the same block after a different prefix hashes differently
    assert hash_blocks([9, 9, 9, 9, 5, 6, 7, 8], BS)[1] != h1[1]
    assert hash_blocks([1, 2, 3, 4], BS) == hash_blocks([1, 2, 3, 4], BS)


def test_prefix_hit_reuses_exact_blocks_and_leaves_one_token():
    kv = make_manager(8)
    a = make_request("a", list(range(10)))  # blocks 0,1 full, block 2 partial
    assert run_prefill(kv, a) == []
    assert a.block_ids == [0, 1, 2]
    assert a.num_registered_blocks == 2
    b = make_request("b", list(range(8)) + [100, 101, 102])
    hits = run_prefill(kv, b)
    assert [h.block_id for h in hits] == [0, 1]
    assert b.block_ids == [0, 1, 3]
    assert pool_refs(kv) == {0: 2, 1: 2, 2: 1, 3: 1}
    # a prompt that is exactly cached still computes its last token: hit covers one block only
    c = make_request("c", list(range(8)))
    hits = kv.find_cached_prefix(c)
    assert [h.block_id for h in hits] == [0]
    kv.pool.check_integrity()


def pool_refs(kv):
    return {b.block_id: b.ref_count for b in kv.pool.blocks if b.ref_count}


def test_free_keeps_hashes_until_evicted_lru():
    kv = make_manager(4)
    a = make_request("a", list(range(8)) + [50])  # 3 blocks: two full (cached), one partial
    run_prefill(kv, a)
    kv.free(a)
    assert list(kv.pool.free_queue) == [3, 2, 1, 0]
    assert len(kv.pool.cached) == 2
    # A new unrelated request takes block 3 first (never cached), then 2 (partial), then 1:
    b = make_request("b", [7] * 11)
    assert kv.allocate(b, 11)
    assert b.block_ids == [3, 2, 1]
    # block 1 held a's second full block: it was evicted, block 0 (a's head) is still cached
    assert len(kv.pool.cached) == 1
    cursor, stored, evicted = kv.pool.events_since(0)
    assert len(stored) == 2 and len(evicted) == 1 and evicted[0] == a.block_hashes[1]
    c = make_request("c", list(range(8)) + [60])
    assert [h.block_id for h in kv.find_cached_prefix(c)] == [0]
    kv.pool.check_integrity()


def test_can_allocate_counts_reclaimed_cache_hits():
    kv = make_manager(3)
    a = make_request("a", list(range(9)))
    run_prefill(kv, a)
    kv.free(a)  # all 3 blocks free, blocks 0,1 cached
    b = make_request("b", list(range(8)) + [1, 2, 3, 4, 5])  # hits 0,1; needs 2 more (13 tokens)
    hits = kv.find_cached_prefix(b)
    assert len(hits) == 2
    assert not kv.can_allocate(b, 5, hits)  # only one block is left once the hits are taken
    assert kv.can_allocate(b, 4, hits)
    kv.pool.check_integrity()


def test_alloc_free_evict_cycles_keep_integrity():
    kv = make_manager(16)
    live = []
    for i in range(200):
        tokens = [(i * 7 + j) % 5 for j in range(3 + (i * 13) % 20)]
        req = make_request(str(i), tokens)
        hits = kv.find_cached_prefix(req)
        if kv.can_allocate(req, req.num_tokens - len(hits) * BS, hits):
            run_prefill(kv, req)
            live.append(req)
        if len(live) > 3 or (live and i % 3 == 0):
            kv.free(live.pop(0))
        kv.pool.check_integrity()
    for req in live:
        kv.free(req)
    assert kv.pool.is_whole()
    kv.pool.check_integrity()


def test_double_free_is_an_error():
    pool = BlockPool(2)
    blocks = pool.allocate(1)
    pool.free(blocks)
    with pytest.raises(RuntimeError):
        pool.free(blocks)

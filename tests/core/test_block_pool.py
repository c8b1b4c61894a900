import pytest

from pagedserve.core.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock


def ids(blocks):
    return [b.block_id for b in blocks]


def test_free_queue_operations_keep_links_consistent():
    blocks = [KVCacheBlock(i) for i in range(6)]
    q = FreeKVCacheBlockQueue(blocks)
    assert q.num_free_blocks == 6 and ids(q.get_all_free_blocks()) == [0, 1, 2, 3, 4, 5]
    assert q.popleft() is blocks[0]
    assert blocks[0].prev_free_block is None and blocks[0].next_free_block is None
    q.remove(blocks[3])  # from the middle
    q.remove(blocks[5])  # the tail
    assert ids(q.get_all_free_blocks()) == [1, 2, 4] and q.num_free_blocks == 3
    q.append(blocks[5])
    q.append_n([blocks[0], blocks[3]])
    assert ids(q.get_all_free_blocks()) == [1, 2, 4, 5, 0, 3] and q.num_free_blocks == 6
    assert ids(q.popleft_n(4)) == [1, 2, 4, 5]
    assert ids(q.get_all_free_blocks()) == [0, 3] and q.num_free_blocks == 2
    q.append_n([])
    assert q.num_free_blocks == 2
    assert ids(q.popleft_n(2)) == [0, 3]
    assert q.get_all_free_blocks() == [] and q.num_free_blocks == 0
    with pytest.raises(ValueError):
        q.popleft()
    with pytest.raises(ValueError):
        q.popleft_n(1)
    with pytest.raises(ValueError, match="not in the free queue"):
        q.remove(blocks[1])
    q.append(blocks[2])
    assert ids(q.get_all_free_blocks()) == [2]


def test_null_block_is_reserved():
    pool = BlockPool(5, enable_caching=True)
    assert pool.null_block is pool.blocks[0] and pool.null_block.is_null
    assert pool.get_num_free_blocks() == 4
    got = pool.get_new_blocks(4)
    assert ids(got) == [1, 2, 3, 4] and all(b.ref_cnt == 1 for b in got)
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    with pytest.raises(ValueError, match=">= 2"):
        BlockPool(1, True)


def test_free_appends_in_given_order_and_reuse_is_lru():
    pool = BlockPool(6, enable_caching=True)
    a = pool.get_new_blocks(3)  # 1, 2, 3
    pool.free_blocks(reversed(a))
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [4, 5, 3, 2, 1]
    assert ids(pool.get_new_blocks(2)) == [4, 5]


def test_usage_excludes_null_block_and_counts_cached_free_as_free():
    pool = BlockPool(5, enable_caching=True)
    assert pool.get_usage() == 0.0
    blocks = pool.get_new_blocks(2)
    assert pool.get_usage() == pytest.approx(0.5)
    pool.cache_full_blocks(blocks, [111, 222], 0, 2)
    pool.free_blocks(blocks)
    assert pool.get_usage() == 0.0 and pool.num_cached_blocks == 2


def test_cache_touch_and_evict_on_reuse():
    pool = BlockPool(4, enable_caching=True)
    b1, b2 = pool.get_new_blocks(2)
    pool.cache_full_blocks([b1, b2], [11, 22], 0, 1)  # only the first is full
    assert b1.block_hash == 11 and b2.block_hash is None
    assert pool.get_cached_block(11) is b1 and pool.get_cached_block(22) is None
    pool.free_blocks([b1, b2])
    assert b1.ref_cnt == 0 and pool.get_cached_block(11) is b1  # free but still hittable
    # A hit takes the free cached block back out of the queue.
    pool.touch([b1])
    assert b1.ref_cnt == 1 and b1 not in pool.free_block_queue.get_all_free_blocks()
    pool.touch([b1])
    assert b1.ref_cnt == 2
    pool.free_blocks([b1])
    pool.free_blocks([b1])
    # Reuse pops the LRU head: block 3 (never used), then 2, then the cached 1 which is evicted.
    got = pool.get_new_blocks(3)
    assert ids(got) == [3, 2, 1]
    assert b1.block_hash is None and pool.get_cached_block(11) is None


def test_duplicate_hash_keeps_first_block_canonical():
    pool = BlockPool(4, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], [7], 0, 1)
    pool.cache_full_blocks([b], [7], 0, 1)
    assert pool.get_cached_block(7) is a and b.block_hash is None


def test_no_caching_mode_never_registers():
    pool = BlockPool(4, enable_caching=False)
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(blocks, [5], 0, 1)
    assert pool.get_cached_block(5) is None and blocks[0].block_hash is None


def test_double_free_is_an_error():
    pool = BlockPool(3, enable_caching=True)
    (b,) = pool.get_new_blocks(1)
    pool.free_blocks([b])
    with pytest.raises(ValueError, match="double free"):
        pool.free_blocks([b])


def test_reset_prefix_cache_only_when_idle():
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [1, 2], 0, 2)
    assert pool.reset_prefix_cache() is False and pool.num_cached_blocks == 2
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert pool.num_cached_blocks == 0 and all(b.block_hash is None for b in pool.blocks)

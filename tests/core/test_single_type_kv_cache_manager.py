"""The per-attention-type managers: each group's tables and the rules of its type."""

import pytest

from pagedserve.core.block_pool import BlockPool, group_block_key
from pagedserve.core.single_type_kv_cache_manager import (
    FullAttentionManager,
    SlidingWindowManager,
    first_block_in_window,
    make_manager,
    max_blocks_held,
)

HASHES = [11, 22, 33, 44, 55]


def cache_positions(pool: BlockPool, group: int, positions) -> dict[int, object]:
    """Register one block per position under the group's key, as a finished request leaves them."""
    blocks = pool.get_new_blocks(len(HASHES))
    for i in positions:
        pool.cache_full_blocks(blocks, HASHES, i, i + 1, group)
    pool.free_blocks(reversed(blocks))
    return {i: blocks[i] for i in positions}


def test_window_rule():
    # The next token (position 6) reads the 3 tokens 4..6: blocks of 2 from position 2 on.
    assert first_block_in_window(6, 3, 2) == 2
    assert first_block_in_window(2, 3, 2) == 0  # the window reaches back before the first token
    assert first_block_in_window(9, 3, 2) == 3


def test_sliding_window_manager_releases_blocks_before_the_window():
    pool = BlockPool(16)
    manager = SlidingWindowManager(pool, block_size=2, group=1, window=3)
    manager.add_request("a")
    blocks = pool.get_new_blocks(5)
    manager.append_blocks("a", blocks)
    released = manager.remove_skipped_blocks("a", 6)
    assert released == blocks[:2]  # in position order: their eviction order
    assert [b.is_null for b in manager.get_blocks("a")] == [True, True, False, False, False]
    assert manager.remove_skipped_blocks("a", 6) == []  # released once
    assert manager.remove_skipped_blocks("a", 5) == []  # a rejected draft never brings the window back
    assert manager.remove_skipped_blocks("a", 9) == [blocks[2]]
    assert manager.num_held_blocks("a") == 2
    manager.check_table("a", manager.get_blocks("a"))  # leading nulls are released positions
    assert manager.pop("a") is not None and manager.num_skipped_block == {}


def test_full_attention_manager_keeps_every_block():
    pool = BlockPool(8)
    manager = FullAttentionManager(pool, block_size=2, group=0)
    manager.add_request("a")
    manager.append_blocks("a", pool.get_new_blocks(3))
    assert manager.remove_skipped_blocks("a", 100) == []
    table = list(manager.get_blocks("a"))
    table[0] = pool.null_block
    with pytest.raises(AssertionError, match="null blocks"):
        manager.check_table("a", table)


def test_null_entries_after_a_held_block_break_a_sliding_table():
    pool = BlockPool(8)
    manager = SlidingWindowManager(pool, block_size=2, group=0, window=3)
    table = [*pool.get_new_blocks(1), pool.null_block]
    with pytest.raises(AssertionError, match="null blocks"):
        manager.check_table("a", table)


def test_full_attention_hit_stops_at_the_first_uncached_position():
    pool = BlockPool(16)
    cached = cache_positions(pool, 0, [0, 1, 3, 4])
    manager = FullAttentionManager(pool, block_size=2, group=0)
    assert manager.find_longest_cache_hit(HASHES, 5) == [cached[0], cached[1]]
    assert manager.find_longest_cache_hit(HASHES, 1) == [cached[0]]
    # Another group's blocks of the same tokens are keyed apart.
    assert FullAttentionManager(pool, block_size=2, group=1).find_longest_cache_hit(HASHES, 5) == []


def test_sliding_window_hit_needs_only_the_last_window():
    pool = BlockPool(16)
    cached = cache_positions(pool, 1, [2, 3, 4])  # positions 0 and 1 were evicted
    manager = SlidingWindowManager(pool, block_size=2, group=1, window=3)
    null = pool.null_block
    # A hit of 5 positions (10 tokens): token 10 reads tokens 8..10, block 4 alone.
    assert manager.find_longest_cache_hit(HASHES, 5) == [null] * 4 + [cached[4]]
    # Block 4 gone: any hit reading it is out; 4 positions read block 3 only.
    key = group_block_key(HASHES[4], 1)
    del pool.cached_block_hash_to_block[key]
    cached[4].block_hash = None
    assert manager.find_longest_cache_hit(HASHES, 5) == [null] * 3 + [cached[3]]
    # A full-attention group needs every position: no hit at all.
    assert FullAttentionManager(pool, block_size=2, group=1).find_longest_cache_hit(HASHES, 5) == []


def test_append_hit_counts_the_hits_leading_nulls_as_released():
    pool = BlockPool(16)
    cached = cache_positions(pool, 0, [3, 4])
    manager = SlidingWindowManager(pool, block_size=2, group=0, window=3)
    hit = manager.find_longest_cache_hit(HASHES, 5)
    manager.add_request("a")
    pool.touch(hit)
    manager.append_hit("a", hit, 10)
    assert manager.num_skipped_block["a"] == 4 and manager.num_held_blocks("a") == 1
    assert manager.remove_skipped_blocks("a", 10) == []
    assert manager.get_blocks("a")[4] is cached[4]


def test_max_blocks_held_is_each_types_rule():
    assert FullAttentionManager.max_blocks_held_by(100, 16, None, 256) == 7
    # A window of 64 tokens, steps of at most 9: the window of a step's first token through
    # its last spans 64 + 8 tokens, which may straddle ceil(72 / 16) + 1 = 6 blocks.
    assert SlidingWindowManager.max_blocks_held_by(1024, 16, 64, 9) == 6
    assert SlidingWindowManager.max_blocks_held_by(20, 16, 64, 9) == 2  # never more than every position
    assert max_blocks_held(1024, 16, (None, 64, 64), 9) == 64 + 6 + 6
    assert make_manager(BlockPool(4), 16, 1, 64).max_blocks_held(1024, 9) == 6
    assert make_manager(BlockPool(4), 16, 0, None).max_blocks_held(1024, 9) == 64

"""Snapshots of the block pool: change tracking and the text picture."""

from __future__ import annotations

import pytest

from pagedserve.core.block_pool import BlockPool
from pagedserve.core.snapshot import KVSnapshot, block_state, render_block_pool, take_snapshot


def _snapshot(pool: BlockPool, full: bool = True) -> KVSnapshot:
    return take_snapshot(pool, 16, [], [], lambda request_id: [], full)


def test_unwatched_pool_records_nothing():
    pool = BlockPool(8)
    pool.get_new_blocks(2)
    assert pool.changed_block_ids is None and pool.take_changed_block_ids() == []


def test_changes_are_recorded_once_and_taken():
    pool = BlockPool(8)
    pool.track_changes(True)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], [123], 0, 1)
    assert pool.take_changed_block_ids() == [a.block_id, b.block_id]
    assert pool.take_changed_block_ids() == []
    pool.free_blocks([b])
    pool.touch([a])  # a second holder
    assert _snapshot(pool, full=False).blocks == [block_state(a), block_state(b)]
    assert block_state(a) == (a.block_id, 2, f"{123:032x}"[:8]) and block_state(b) == (b.block_id, 0, None)
    pool.track_changes(False)
    pool.free_blocks([a])
    assert pool.take_changed_block_ids() == []


def test_full_snapshot_lists_every_block_and_leaves_pending_changes_to_the_next_delta():
    pool = BlockPool(6)
    pool.track_changes(True)
    blocks = pool.get_new_blocks(3)
    snap = _snapshot(pool)
    assert snap.full and [b[0] for b in snap.blocks] == list(range(6)) and snap.null_block_id == 0
    # A full picture taken for another reader (generate --show-blocks) must not eat a watcher's delta.
    assert _snapshot(pool, full=False).blocks == [block_state(b) for b in blocks]


def test_render_block_pool_marks_each_state():
    pool = BlockPool(8)
    used, shared, cached = pool.get_new_blocks(3)
    pool.touch([shared])
    pool.cache_full_blocks([cached], [7], 0, 1)
    pool.free_blocks([cached])
    text = render_block_pool(_snapshot(pool))
    picture, legend = text.splitlines()
    assert picture == "0#Sc...."
    assert "in use 1" in legend and "shared 1" in legend and "cached 1" in legend and "free 4" in legend


def test_render_groups_blocks_on_big_pools_and_shows_the_busiest_state():
    pool = BlockPool(1000)
    pool.get_new_blocks(1)  # block 1, grouped with the null block: in use wins
    text = render_block_pool(_snapshot(pool), width=10, max_lines=10)
    lines = text.splitlines()
    assert len(lines) == 11 and lines[0].startswith("#.") and "one character = 10 blocks" in lines[-1]


def test_render_needs_a_full_snapshot():
    with pytest.raises(ValueError, match="full snapshot"):
        render_block_pool(_snapshot(BlockPool(4), full=False))

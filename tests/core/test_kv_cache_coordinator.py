"""The coordinator over per-group managers, and the tier as its collaborator."""

from core_helpers import FakeTier, admit, make_request

from pagedserve.core.block_pool import group_block_key
from pagedserve.core.kv_cache_coordinator import interleave
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.kv_cache_utils import hash_request_blocks
from pagedserve.core.kv_tier import KVTransfers
from pagedserve.core.kv_tier_connector import SwappedTail, TierConnector


def test_interleave_is_position_major():
    assert interleave([[1, 3, 5], [2, 4, 6]]) == [1, 2, 3, 4, 5, 6]
    assert interleave([[7, 8]]) == [7, 8]


def test_groups_get_blocks_in_the_order_the_runner_reads_them():
    kvm = KVCacheManager(32, 2, 64, group_windows=(None, 3))
    req = make_request("a", 8)
    new, _ = admit(kvm, req)
    assert [b.block_id for b in new] == list(range(1, 9))  # popped once, position-major
    full, sliding = kvm.coordinator.managers
    assert [b.block_id for b in full.get_blocks("a")] == [1, 3, 5, 7]
    assert [b.block_id for b in sliding.get_blocks("a")] == [2, 4, 6, 8]
    assert kvm.get_block_ids("a") == list(range(1, 9))
    # Decoding on: the sliding group's positions before the window turn null (id 0).
    for _ in range(2):
        req.append_output_token_id(5)
        kvm.allocate_slots(req, 1)
        req.num_computed_tokens += 1
    assert kvm.get_block_ids("a") == [1, 0, 3, 0, 5, 0, 7, 8, 9, 10]
    assert kvm.num_held_blocks("a", 0) == 5 and kvm.num_held_blocks("a", 1) == 2
    kvm.check_invariants()
    kvm.free(req)
    # Tail first, the last position's last group first: the prefix is evicted last.
    queue = [b.block_id for b in kvm.block_pool.free_block_queue.get_all_free_blocks()]
    assert queue[-7:] == [10, 9, 8, 7, 5, 3, 1]
    kvm.check_invariants()


def test_hybrid_hit_is_the_longest_every_group_serves():
    kvm = KVCacheManager(32, 2, 64, group_windows=(None, 4))
    prompt = list(range(100, 110))  # 5 full blocks
    a = make_request("a", prompt)
    admit(kvm, a)
    kvm.free(a)
    b = make_request("b", prompt + [1, 2])
    blocks, hit = kvm.get_computed_blocks(b)
    assert hit == 10
    # Token 10 reads tokens 7..10 in the sliding group: positions 3 and 4 only.
    assert [blk.is_null for blk in blocks[1::2]] == [True, True, True, False, False]
    assert not any(blk.is_null for blk in blocks[0::2])
    # The sliding group's first block evicted: still a hit, it is not read.
    pool = kvm.block_pool
    first = pool.cached_block_hash_to_block.pop(group_block_key(b.block_hashes[0], 1))
    first.block_hash = None
    assert kvm.get_computed_blocks(b)[1] == 10
    # The sliding group's last one evicted: the hit shrinks until its window is whole.
    last = pool.cached_block_hash_to_block.pop(group_block_key(b.block_hashes[4], 1))
    last.block_hash = None
    blocks, hit = kvm.get_computed_blocks(b)
    assert hit == 8 and [blk.is_null for blk in blocks[1::2]] == [True, True, False, False]
    new, _ = admit(kvm, b)
    assert new is not None and kvm.get_block_ids("b")[1:4:2] == [0, 0]
    kvm.check_invariants()
    # The full group's first block evicted: no hit at all.
    kvm.free(b)
    first_full = pool.cached_block_hash_to_block.pop(b.block_hashes[0])
    first_full.block_hash = None
    assert kvm.get_computed_blocks(make_request("c", prompt + [3]))[1] == 0


def test_tier_connector_loads_whole_blocks_past_the_pool():
    tier = FakeTier()
    connector = TierConnector(tier, 4, enable_caching=True, swap=False, store_computed=True)
    kvm = KVCacheManager(16, 4, 64)
    req = make_request("a", 10)
    hashes = hash_request_blocks(req, 4)
    tier.entries = {hashes[0]: ["x"] * 4, hashes[1]: ["y"] * 4}
    assert connector.get_num_new_matched_tokens(req, 0) == 8
    assert connector.get_num_new_matched_tokens(req, 4) == 4  # after a pool hit of one block
    blocks = kvm.block_pool.get_new_blocks(2)
    transfers = KVTransfers()
    connector.update_state_after_alloc(req, 1, blocks, transfers)
    assert transfers.loads == [(blocks[0].block_id, hashes[1])]
    assert connector.num_queries == 10 - 4 and connector.num_hits == 4


def test_tier_connector_swaps_out_the_partly_filled_last_block():
    tier = FakeTier()
    connector = TierConnector(tier, 4, enable_caching=False, swap=True, store_computed=False)
    kvm = KVCacheManager(16, 4, 64)
    req = make_request("a", 10)
    blocks = kvm.block_pool.get_new_blocks(3)
    req.num_computed_tokens = 6
    transfers = KVTransfers()
    connector.request_freed(req, blocks, True, transfers)
    (full, _), (part, key) = transfers.swap_outs
    assert (full, part) == (blocks[0].block_id, blocks[1].block_id)
    assert connector.swapped == {"a": SwappedTail(1, 2, key)}
    for block_id, k in transfers.swap_outs:  # what the runner does
        tier.entries[k] = [block_id]
    req.num_computed_tokens = 0
    # The resumption finds its whole block and its partial one, in one lookup.
    assert connector.get_num_new_matched_tokens(req, 0) == 6
    loads = KVTransfers()
    connector.update_state_after_alloc(req, 0, kvm.block_pool.get_new_blocks(3), loads)
    assert [k for _, k in loads.loads] == [req.block_hashes[0], key] and connector.swapped == {}
    connector.request_freed(req, [], False, loads)  # a finished request forgets it all
    assert connector.swapped == {}

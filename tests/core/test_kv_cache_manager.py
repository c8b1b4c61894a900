import pytest
from core_helpers import admit, make_request

from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.kv_cache_utils import hash_request_tokens


def test_allocation_arithmetic_and_block_ids():
    kvm = KVCacheManager(10, 4, 64)
    req = make_request(1, 10)
    new, hit = admit(kvm, req)
    assert hit == 0 and [b.block_id for b in new] == [1, 2, 3]
    assert kvm.get_block_ids("1") == [1, 2, 3]
    assert kvm.usage == pytest.approx(3 / 9)
    # Decode steps: tokens 11 and 12 fit in block 3; token 13 needs a new block.
    for expected in ([], [], [4]):
        req.append_output_token_id(5)
        new = kvm.allocate_slots(req, 1)
        req.num_computed_tokens += 1
        assert [b.block_id for b in new] == expected
    kvm.free(req)
    assert kvm.usage == 0.0 and kvm.get_block_ids("1") == []


def test_lookahead_and_max_model_len_cap():
    kvm = KVCacheManager(20, 4, 12)
    req = make_request(1, 8)
    assert len(kvm.allocate_slots(req, 8, num_lookahead_tokens=3)) == 3
    req2 = make_request(2, 8)
    # 8 + 10 lookahead would need 5 blocks, but max_model_len caps slots at 12 tokens.
    assert len(kvm.allocate_slots(req2, 8, num_lookahead_tokens=10)) == 3
    with pytest.raises(ValueError, match="num_new_tokens"):
        kvm.allocate_slots(req2, 0)


def test_failed_allocation_changes_nothing():
    kvm = KVCacheManager(5, 4, 64)  # 4 usable blocks
    a = make_request(1, 8)
    admit(kvm, a)
    b = make_request(2, [1] * 4 + list(range(100, 112)))  # 4 blocks, 2 free
    before = (kvm.num_free_blocks, dict(kvm.req_to_blocks), [blk.ref_cnt for blk in kvm.block_pool.blocks])
    new, _ = admit(kvm, b)
    assert new is None
    after = (kvm.num_free_blocks, dict(kvm.req_to_blocks), [blk.ref_cnt for blk in kvm.block_pool.blocks])
    assert before == after and "2" not in kvm.req_to_blocks


def test_prefix_hit_shares_blocks_of_running_request():
    kvm = KVCacheManager(20, 4, 64)
    prompt = list(range(100, 110))  # 2 full blocks + 2 tokens
    a, b = make_request("a", prompt), make_request("b", prompt + [7, 7])
    admit(kvm, a)
    new_b, hit = admit(kvm, b)
    assert hit == 8
    shared = kvm.req_to_blocks["a"][:2]
    assert kvm.req_to_blocks["b"][:2] == shared
    assert all(blk.ref_cnt == 2 for blk in shared)
    assert new_b == kvm.req_to_blocks["b"][2:] and len(new_b) == 1
    assert kvm.prefix_cache_queries == 10 + 12 and kvm.prefix_cache_hits == 8
    assert kvm.prefix_cache_hit_rate == pytest.approx(8 / 22)
    assert b.block_hashes == hash_request_tokens(b.all_token_ids, 4)


def test_fully_cached_prompt_recomputes_last_token():
    kvm = KVCacheManager(20, 4, 64)
    prompt = list(range(12))  # exactly 3 full blocks
    a = make_request("a", prompt)
    admit(kvm, a)
    kvm.free(a)
    b = make_request("b", prompt)
    new, hit = admit(kvm, b)
    assert hit == 8  # not 12: the last token (and so its whole block) is recomputed
    assert len(new) == 1
    # The third block is a fresh copy; the old cached one stays canonical for its hash.
    assert kvm.get_block_ids("b") == [1, 2, 4]
    assert kvm.block_pool.blocks[3].block_hash == b.block_hashes[2]
    assert kvm.block_pool.blocks[4].block_hash is None


def test_hits_on_free_cached_blocks_count_against_free_space():
    kvm = KVCacheManager(4, 2, 64)  # 3 usable blocks
    prompt = [1, 2, 3, 4, 5]
    a = make_request("a", prompt)
    admit(kvm, a)
    kvm.free(a)
    assert kvm.num_free_blocks == 3 and kvm.block_pool.num_cached_blocks == 2
    b = make_request("b", prompt + [6, 7, 8])  # hits 2 blocks, needs 2 more: 4 > 3
    new, _ = admit(kvm, b)
    assert new is None and all(blk.ref_cnt == 0 for blk in kvm.block_pool.blocks[1:])
    c = make_request("c", prompt + [6])  # hits 2 blocks, needs 1 more
    new, hit = admit(kvm, c)
    assert hit == 4 and new is not None and kvm.num_free_blocks == 0


def test_free_releases_tail_first_so_prefix_survives_longest():
    kvm = KVCacheManager(5, 2, 64)
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8])  # 4 full blocks: ids 1..4
    admit(kvm, a)
    kvm.free(a)
    queue = [b.block_id for b in kvm.block_pool.free_block_queue.get_all_free_blocks()]
    assert queue == [4, 3, 2, 1]
    # Needing one block evicts the tail block; the prefix [1, 2, 3, 4] still hits.
    x = make_request("x", [9, 9])
    admit(kvm, x)
    b = make_request("b", [1, 2, 3, 4, 5, 6, 0])
    _, hit = admit(kvm, b)
    assert hit == 6


def test_stats_count_an_admission_once_and_keep_resumptions_apart():
    kvm = KVCacheManager(20, 4, 64)
    req = make_request("a", 9)
    kvm.get_computed_blocks(req)
    kvm.get_computed_blocks(req)  # blocked at the queue head, looked up again: no side effects
    assert kvm.prefix_cache_queries == 0 and kvm.prefix_cache_requests == 0
    admit(kvm, req)
    assert kvm.prefix_cache_queries == 9 and kvm.prefix_cache_requests == 1
    kvm.free(req)
    req.num_computed_tokens = 0
    req.num_preemptions = 1
    _, hit = admit(kvm, req)
    assert hit == 8
    assert kvm.prefix_cache_queries == 9 and kvm.prefix_cache_hits == 0
    assert kvm.preempted_prefix_cache_queries == 9 and kvm.preempted_prefix_cache_hits == 8


def test_caching_disabled():
    kvm = KVCacheManager(20, 4, 64, enable_caching=False)
    a, b = make_request("a", 9), make_request("b", 9)
    admit(kvm, a)
    _, hit = admit(kvm, b)
    assert hit == 0 and kvm.block_pool.num_cached_blocks == 0
    assert set(kvm.get_block_ids("a")).isdisjoint(kvm.get_block_ids("b"))


def test_blocks_are_cached_as_they_fill_during_decode():
    kvm = KVCacheManager(20, 4, 64)
    req = make_request("a", 6)
    admit(kvm, req)
    assert kvm.block_pool.num_cached_blocks == 1
    req.append_output_token_ids([1])
    kvm.allocate_slots(req, 1)
    req.num_computed_tokens += 1
    req.append_output_token_ids([2])  # 8 tokens, but the 8th is not computed yet
    assert kvm.block_pool.num_cached_blocks == 1
    kvm.allocate_slots(req, 1)
    req.num_computed_tokens += 1
    assert kvm.block_pool.num_cached_blocks == 2
    assert kvm.req_to_blocks["a"][1].block_hash == req.block_hashes[1]


def test_reset_prefix_cache():
    kvm = KVCacheManager(20, 4, 64)
    req = make_request("a", 9)
    admit(kvm, req)
    assert kvm.reset_prefix_cache() is False
    kvm.free(req)
    assert kvm.reset_prefix_cache() is True
    _, hit = admit(kvm, make_request("b", 9))
    assert hit == 0


def test_cache_salts_never_share_blocks():
    kvm = KVCacheManager(20, 4, 64)
    tokens = list(range(12))
    a = make_request("a", tokens)
    a.cache_salt = "tenant-1"
    admit(kvm, a)
    kvm.free(a)
    for rid, salt in [("b", "tenant-2"), ("c", None)]:
        other = make_request(rid, tokens)
        other.cache_salt = salt
        _, hit = admit(kvm, other)
        assert hit == 0, f"{rid} ({salt}) reused tenant-1's blocks"
        kvm.free(other)
    same = make_request("d", tokens)
    same.cache_salt = "tenant-1"
    _, hit = admit(kvm, same)
    assert hit == 8


def test_check_invariants_names_each_kind_of_corruption():
    """The product's own integrity check (the state machines run it after every rule):
    silent on a true state, and each corruption it exists for is caught by name."""
    def state():
        kvm = KVCacheManager(12, 4, 64)
        prompt = list(range(100, 110))
        a, b = make_request("a", prompt), make_request("b", prompt + [7])
        admit(kvm, a)
        admit(kvm, b)
        kvm.check_invariants()
        return kvm

    kvm = state()
    kvm.req_to_blocks["a"][2].ref_cnt += 1  # a leaked reference
    with pytest.raises(AssertionError, match="held by 1 tables"):
        kvm.check_invariants()
    kvm = state()
    kvm.block_pool.free_block_queue.append(kvm.req_to_blocks["b"][2])  # a held block also free
    with pytest.raises(AssertionError, match="free queue"):
        kvm.check_invariants()
    kvm = state()
    shared = kvm.req_to_blocks["a"][0]
    del kvm.block_pool.cached_block_hash_to_block[shared.block_hash]  # shared but no longer cached
    with pytest.raises(AssertionError, match="shared but is not the cached block"):
        kvm.check_invariants()
    kvm = state()
    kvm.coordinator.managers[0].req_to_blocks["a"][1] = kvm.block_pool.null_block  # a null in a full-attention table
    with pytest.raises(AssertionError, match="null blocks"):
        kvm.check_invariants()

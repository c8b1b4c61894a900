"""The radix tree over cached blocks, and the KV-cache manager's partial hits with it."""

from __future__ import annotations

from core_helpers import FakeRunner, make_request, make_scheduler, run_to_completion

from pagedserve.core.radix_index import RadixIndex, common_prefix_len


def test_longest_match_among_a_prefixs_children() -> None:
    r = RadixIndex()
    r.insert("root", 5, [1, 2, 3, 4])
    r.insert("root", 6, [1, 2, 9])
    r.insert(77, 7, [1, 2, 3, 4])  # another prefix's child
    assert r.longest_match("root", [1, 2, 3, 8]) == (5, 3)
    assert r.longest_match("root", [1, 2, 9, 9]) == (6, 3)
    assert r.longest_match("root", [2]) == (0, 0) and r.longest_match(99, [1]) == (0, 0)
    r.remove(5)
    assert r.longest_match("root", [1, 2, 3, 8]) == (6, 2)
    r.insert(77, 6, [1])  # a block handed out again and re-registered elsewhere moves
    assert r.longest_match("root", [1]) == (0, 0) and len(r) == 2
    r.remove(123)  # not a node: nothing happens
    r.clear()
    assert len(r) == 0 and not r.children
    assert common_prefix_len([1, 2, 3], [1, 2]) == 2 and common_prefix_len([], [1]) == 0


def _second_turn(radix: bool) -> tuple[object, object, object]:
    """A first request of 7 prompt tokens and 4 answers (10 with KV: its last block
    holds 2), then a second whose prompt repeats 9 of them and goes on differently."""
    sched = make_scheduler(num_blocks=32, block_size=4, radix=radix)
    runner = FakeRunner(sched)
    first = make_request("a", [1, 2, 3, 4, 5, 6, 7], max_tokens=4)
    sched.add_request(first)
    run_to_completion(sched, runner)
    out = first.output_token_ids
    second = make_request("b", [1, 2, 3, 4, 5, 6, 7, out[0], out[1], out[2] + 1, 91], max_tokens=2)
    sched.add_request(second)
    so = sched.schedule()
    return sched, runner, so


def test_partial_hit_copies_the_finished_requests_last_block() -> None:
    sched, runner, so = _second_turn(radix=True)
    (new,) = so.scheduled_new_reqs
    # Blocks 0 and 1 from the hash chain, then [out1] of block 2 from the first
    # request's last block ([out1, out2]), copied into the second's own block.
    assert new.num_computed_tokens == 9 and len(so.kv_transfers.copies) == 1
    src, dst = so.kv_transfers.copies[0]
    assert dst == new.block_ids[2] and src != dst
    sched.update_from_output(so, runner.execute(so, lambda rid, ctx: 3))  # the runner checks the copied slot
    run_to_completion(sched, runner)
    assert sched.kv_cache_manager.usage == 0

    _, _, so = _second_turn(radix=False)
    assert so.scheduled_new_reqs[0].num_computed_tokens == 8  # the hash chain: whole blocks only
    assert so.kv_transfers is None


def test_tier_and_radix_are_refused_for_sliding_window_models() -> None:
    import pytest
    from core_helpers import FakeTier

    from pagedserve.core.kv_cache_manager import KVCacheManager

    # every layer sliding (Mistral: one KV-cache group, which the messages named as the
    # reason, "several groups", or as what it needs, "one group"), or a hybrid (Gemma 3)
    for windows in [(5,), (None, 3)]:
        with pytest.raises(ValueError, match="sliding-window layers") as e:
            KVCacheManager(16, 4, 64, group_windows=windows, tier=FakeTier())
        assert "group" not in str(e.value)
        with pytest.raises(ValueError, match="without sliding-window layers") as e:
            KVCacheManager(16, 4, 64, group_windows=windows, radix=True)
        assert "group" not in str(e.value)

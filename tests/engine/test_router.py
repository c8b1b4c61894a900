"""The data-parallel router (engine/router.py): policies, loads, the prefix index."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.config import RouterConfig
from pagedserve.engine.router import NoReplicaError, PrefixIndex, Router
from tests.hypothesis_budget import examples

BS = 4


def router(policy: str = "cache_aware", n: int = 2, capacity: int = 64, **kw) -> Router:
    return Router(RouterConfig(policy=policy, **kw), n, BS, capacity)


def prompt(prefix: int, length: int = 16, suffix: int = 0) -> list[int]:
    return [prefix * 1000 + i for i in range(length)] + [7] * suffix


def send(r: Router, ids: list[int]) -> int:
    hashes = r.block_hashes(ids)
    d = r.choose(hashes, len(ids))
    r.dispatched(d.replica, hashes)
    return d.replica


def test_round_robin_takes_turns_and_skips_replicas_that_are_down():
    r = router("round_robin", n=3)
    assert [send(r, prompt(0)) for _ in range(4)] == [0, 1, 2, 0]
    r.set_up(1, False)
    assert [send(r, prompt(0)) for _ in range(3)] == [2, 0, 2]
    with pytest.raises(NoReplicaError):
        r.choose([], 0, exclude={0, 2})


def test_least_loaded_weighs_waiting_four_times_and_counts_dispatches_at_once():
    r = router("least_loaded")
    # A burst with no report in between still spreads: each dispatch counts as waiting.
    assert sorted(send(r, prompt(0)) for _ in range(8)) == [0] * 4 + [1] * 4
    # Replica 0 reports its 4 all running, replica 1 all waiting: 4 against 16.
    r.report(0, num_waiting=0, num_received=4)
    r.report(1, num_waiting=4, num_received=4)
    assert r.loads[0].score == 4 and r.loads[1].score == 16
    assert send(r, prompt(0)) == 0
    # A report that has not seen a request yet leaves it waiting.
    r.report(0, num_waiting=0, num_received=4)
    assert r.loads[0].waiting == 1 and r.loads[0].score == 8
    # A report never counts a request the front end already saw end.
    for _ in range(5):
        r.ended(0)
    r.report(0, num_waiting=3, num_received=5)  # taken before they ended
    assert r.loads[0].score == 0


def test_cache_aware_follows_the_prefix_then_balances_new_ones():
    r = router(cache_threshold=0.5)
    first = {p: send(r, prompt(p, suffix=3)) for p in range(4)}
    assert sorted(first.values()) == [0, 0, 1, 1]  # new prefixes spread: least loaded, then the smaller index
    for _ in range(3):
        for p in range(4):
            d = r.choose(r.block_hashes(prompt(p, suffix=5)), 21)
            assert d.replica == first[p] and d.affinity and d.matched_blocks == 4
    # Below the threshold the match does not count: 1 block of 8 matches.
    long = prompt(0, length=4) + [9] * 28
    d = r.choose(r.block_hashes(long), len(long))
    assert not d.affinity and d.matched_blocks in (0, 1)


def test_imbalance_overrides_affinity():
    r = router(balance_abs_threshold=10, balance_rel_threshold=2.0)
    home = send(r, prompt(1))
    other = 1 - home
    r.dispatched(home, [])  # two waiting: load 8 against 0, not more than 10
    assert r.choose(r.block_hashes(prompt(1)), 16).replica == home
    r.dispatched(home, [])  # load 12 > 0 + 10 and > 0 x 2: imbalanced
    d = r.choose(r.block_hashes(prompt(1)), 16)
    assert d.replica == other and not d.affinity


def test_prefix_index_evicts_least_recently_sent_and_matches_leading_blocks():
    idx = PrefixIndex(capacity=3)
    idx.insert([1, 2, 3])
    idx.insert([1])  # 1 is now the most recent
    idx.insert([4])  # evicts 2, the least recent
    assert len(idx) == 3 and idx.match([1, 2, 3]) == 1 and idx.match([1]) == 1
    assert idx.match([3, 4]) == 2 and idx.match([]) == 0
    idx.clear()
    assert len(idx) == 0


def test_a_restarted_replica_starts_empty():
    r = router()
    home = send(r, prompt(3))
    r.reset(home)
    assert len(r.indexes[home]) == 0 and not r.choose(r.block_hashes(prompt(3)), 16).affinity
    # The request sent before the restart counts until it ends (moved or failed), not after.
    assert r.loads[home].in_flight == 1
    r.dispatched(home, r.block_hashes(prompt(4)))  # a new request on the restarted replica
    r.ended(home)  # the old request ends: the new one still counts
    assert r.loads[home].in_flight == 1
    r.ended(home)
    assert r.loads[home].in_flight == 0 and r.loads[home].score == 0


def test_the_salt_separates_prefixes():
    r = router()
    assert r.block_hashes(prompt(1), "a") != r.block_hashes(prompt(1), "b") != r.block_hashes(prompt(1))
    assert r.block_hashes(None) == [] and r.block_hashes([1, 2]) == []  # no full block


@settings(max_examples=examples(200), deadline=None)
@given(policy=st.sampled_from(["round_robin", "least_loaded", "cache_aware"]),
       ops=st.lists(st.tuples(st.sampled_from(["send", "end", "report", "down", "up", "reset"]),
                              st.integers(0, 2), st.integers(0, 5)), max_size=60))
def test_choices_are_replicas_that_are_up_and_loads_stay_consistent(policy, ops):
    r = router(policy, n=3, capacity=6, balance_abs_threshold=4)
    in_flight = [0, 0, 0]
    for op, replica, k in ops:
        if op == "send":
            ids = prompt(k, length=4 * k + 2)
            hashes = r.block_hashes(ids)
            exclude = {replica} if k % 2 else set()
            candidates = [i for i in range(3) if r.up[i] and i not in exclude]
            if not candidates:
                with pytest.raises(NoReplicaError):
                    r.choose(hashes, len(ids), exclude)
                continue
            d = r.choose(hashes, len(ids), exclude)
            assert d.replica in candidates and 0 <= d.matched_blocks <= len(hashes)
            r.dispatched(d.replica, hashes)
            in_flight[d.replica] += 1
        elif op == "end" and in_flight[replica]:
            r.ended(replica)
            in_flight[replica] -= 1
        elif op == "report":
            r.report(replica, k, k)
        elif op in ("down", "up"):
            r.set_up(replica, op == "up")
        elif op == "reset":
            r.reset(replica)  # (its requests still end one by one, each counted until then)
        for i, load in enumerate(r.loads):
            assert load.in_flight == in_flight[i]
            assert 0 <= load.waiting <= load.in_flight and load.running >= 0
            assert len(r.indexes[i]) <= 6

import itertools

import pytest
from core_helpers import FakeRunner, make_request, make_scheduler, run_to_completion

from pagedserve.core.request import RequestStatus


def step(sched, tokens=None, default=5):
    """One engine step; `tokens` maps request id -> sampled token (default 5 for every request)."""
    so = sched.schedule()
    sampled = {rid: [(tokens or {}).get(rid, default)] for rid in so.num_scheduled_tokens}
    return so, sched.update_from_output(so, sampled)


def test_mixed_step_budget_and_discarded_prefill_sample():
    sched = make_scheduler(block_size=4, max_num_batched_tokens=10)
    a = make_request("a", 6)
    sched.add_request(a)
    so, outs = step(sched)
    assert so.num_scheduled_tokens == {"a": 6} and so.total_num_scheduled_tokens == 6
    assert [o.new_token_ids for o in outs] == [[5]]
    b = make_request("b", 20)
    sched.add_request(b)
    so, outs = step(sched, {"a": 8, "b": 9})
    # One step mixes a's decode with a 9-token chunk of b's prompt.
    assert so.num_scheduled_tokens == {"a": 1, "b": 9} and so.total_num_scheduled_tokens == 10
    assert so.scheduled_cached_reqs.req_ids == ["a"] and [r.req_id for r in so.scheduled_new_reqs] == ["b"]
    # b's prompt is only partly computed: its sample is dropped and nothing is reported for it.
    assert [o.request_id for o in outs] == ["a"] and b.num_output_tokens == 0
    assert b.num_computed_tokens == 9
    so, outs = step(sched)
    assert so.num_scheduled_tokens == {"a": 1, "b": 9}
    so, outs = step(sched, {"b": 4})
    assert so.num_scheduled_tokens == {"a": 1, "b": 2}  # b finishes its prompt and samples
    assert {o.request_id: o.new_token_ids for o in outs} == {"a": [5], "b": [4]}


def test_cached_request_deltas():
    sched = make_scheduler(block_size=4)
    a = make_request("a", 7)
    sched.add_request(a)
    so, _ = step(sched, {"a": 42})
    (nr,) = so.scheduled_new_reqs
    assert nr.block_ids == [1, 2] and nr.num_computed_tokens == 0 and nr.output_token_ids == []
    so, _ = step(sched, {"a": 43})
    c = so.scheduled_cached_reqs
    assert c.req_ids == ["a"] and c.new_token_ids == [[42]] and c.num_computed_tokens == [7]
    assert c.new_block_ids == [[]]  # token 8 still fits block 2
    so, _ = step(sched)
    assert c is not so.scheduled_cached_reqs
    assert so.scheduled_cached_reqs.new_token_ids == [[43]]
    assert so.scheduled_cached_reqs.new_block_ids == [[3]]
    assert so.scheduled_cached_reqs.num_computed_tokens == [8]


def test_long_prefill_threshold_caps_chunks():
    sched = make_scheduler(block_size=4, max_num_batched_tokens=64, long_prefill_token_threshold=5)
    sched.add_request(make_request("a", 12))
    sched.add_request(make_request("b", 3))
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"a": 5, "b": 3}
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"a": 5, "b": 1}
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"a": 2, "b": 1}


def test_chunked_prefill_disabled_waits_for_whole_prompt_budget():
    sched = make_scheduler(block_size=4, max_num_batched_tokens=64, max_model_len=64, enable_chunked_prefill=False)
    sched.add_request(make_request("a", 40))
    sched.add_request(make_request("b", 30))
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"a": 40}  # b does not fit the remaining 24 and is not chunked
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"a": 1, "b": 30}


def test_max_num_seqs_limits_admission():
    sched = make_scheduler(max_num_seqs=2)
    for i in range(4):
        sched.add_request(make_request(i, 3))
    so, _ = step(sched)
    assert set(so.num_scheduled_tokens) == {"0", "1"} and len(sched.waiting) == 2
    assert sched.get_num_unfinished_requests() == 4 and sched.get_request_counts() == (2, 2)


def test_fcfs_preempts_last_running_and_resumes_with_its_tokens():
    sched = make_scheduler(num_blocks=5, block_size=4)  # 4 usable blocks
    a, b = make_request("a", 7, max_tokens=8), make_request("b", 7, max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    step(sched, {"a": 1, "b": 2})
    step(sched, {"a": 1, "b": 3})  # 9 tokens each now; the pool is full
    so, _ = step(sched)
    assert so.preempted_req_ids == {"b"} and so.num_scheduled_tokens == {"a": 1}
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and sched.num_preemptions_total == 1
    assert b.output_token_ids == [2, 3] and sched.kv_cache_manager.get_block_ids("b") == []
    assert list(sched.waiting) == [b] and sched.running == [a]
    # Finish a; b comes back as a new request carrying its outputs.
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    so, outs = step(sched, {"b": 9})
    (nr,) = so.scheduled_new_reqs
    assert nr.req_id == "b" and nr.output_token_ids == [2, 3] and nr.prompt_token_ids == b.prompt_token_ids
    # Its first full block survived in the prefix cache, so it is not recomputed.
    assert nr.num_computed_tokens == 4 and so.num_scheduled_tokens == {"b": 5}
    assert so.finished_req_ids == {"a"}
    assert outs[0].new_token_ids == [9] and b.output_token_ids == [2, 3, 9]
    assert outs[0].num_cached_tokens == 0  # reported from the first admission


def test_fcfs_preempts_the_current_request_when_it_is_last():
    sched = make_scheduler(num_blocks=5, block_size=4)
    a, b = make_request("a", 7, max_tokens=8), make_request("b", 8, max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)  # a: 8 tokens, b: 9 tokens; 4 blocks held
    so, _ = step(sched)
    # a fits its 8th token in block 2; b needs a third block, and b is itself the last running.
    assert so.num_scheduled_tokens == {"a": 1} and so.preempted_req_ids == {"b"}
    assert sched.running == [a] and list(sched.waiting) == [b]


def test_priority_victim_and_no_admission_in_a_preempting_step():
    sched = make_scheduler(num_blocks=5, block_size=4, policy="priority")
    a = make_request("a", 7, max_tokens=8, priority=1, arrival_time=1.0)
    b = make_request("b", 7, max_tokens=8, priority=0, arrival_time=2.0)
    sched.add_request(a)
    sched.add_request(b)
    so, _ = step(sched)
    assert [r.req_id for r in so.scheduled_new_reqs] == ["b", "a"]  # lower value first
    assert sched.running == [b, a]
    step(sched)
    c = make_request("c", 1, priority=-1, arrival_time=3.0)
    sched.add_request(c)
    so, _ = step(sched)
    # b needs a block; the victim is max((priority, arrival)) = a, even though a is not last in time.
    assert so.preempted_req_ids == {"a"} and so.num_scheduled_tokens == {"b": 1}
    # c would fit in the block a freed, but a preempting step admits nobody.
    assert "c" not in so.num_scheduled_tokens
    assert list(sched.waiting) == [c, a]
    so, _ = step(sched)
    assert [r.req_id for r in so.scheduled_new_reqs] == ["c"]


def test_priority_ties_broken_by_arrival():
    sched = make_scheduler(policy="priority", max_num_seqs=1)
    sched.add_request(make_request("late", 3, priority=0, arrival_time=5.0))
    sched.add_request(make_request("early", 3, priority=0, arrival_time=1.0))
    sched.add_request(make_request("urgent", 3, priority=-3, arrival_time=9.0))
    order = []
    while sched.has_unfinished_requests():
        so, _ = step(sched)
        order += [r.req_id for r in so.scheduled_new_reqs]
    assert order == ["urgent", "early", "late"]


@pytest.mark.parametrize(
    "kwargs, tokens, expect_len, reason, stop_reason",
    [
        (dict(eos_token_id=2), [5, 2, 5], 2, "stop", None),
        (dict(eos_token_id=2, ignore_eos=True, max_tokens=3), [5, 2, 5], 3, "length", None),
        (dict(stop_token_ids=[7, 8]), [5, 8, 5], 2, "stop", 8),
        (dict(max_tokens=3), [5, 5, 5, 5], 3, "length", None),
        (dict(eos_token_id=2, min_tokens=3, max_tokens=5), [2, 7, 2, 5], 3, "stop", None),
        (dict(stop_token_ids=[7], min_tokens=2), [7, 7], 2, "stop", 7),
    ],
)
def test_stop_rules(kwargs, tokens, expect_len, reason, stop_reason):
    sched = make_scheduler()
    max_tokens = kwargs.pop("max_tokens", 16)
    eos = kwargs.pop("eos_token_id", None)
    req = make_request("r", 4, max_tokens=max_tokens, eos_token_id=eos, **kwargs)
    sched.add_request(req)
    finals = []
    for tok in tokens:
        _, outs = step(sched, {"r": tok})
        finals = [o for o in outs if o.finished]
        if finals:
            break
    (out,) = finals
    assert req.num_output_tokens == expect_len and req.output_token_ids == tokens[:expect_len]
    assert out.finish_reason == reason and out.stop_reason == stop_reason
    assert req.get_finished_reason() == reason
    assert sched.kv_cache_manager.usage == 0 and not sched.has_unfinished_requests()
    assert sched.schedule().finished_req_ids == {"r"}


def test_max_model_len_caps_generation():
    sched = make_scheduler(max_model_len=10, max_num_batched_tokens=16)
    req = make_request("r", 7, max_tokens=None)
    sched.add_request(req)
    outs = run_to_completion(sched)
    assert req.num_tokens == 10 and req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert outs[-1].finish_reason == "length"


def test_finish_requests_aborts_waiting_and_running():
    sched = make_scheduler(max_num_seqs=1)
    a, b = make_request("a", 9), make_request("b", 9)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    assert sched.kv_cache_manager.usage > 0
    sched.finish_requests(["a", "b", "nope"], RequestStatus.FINISHED_ABORTED)
    assert a.status == b.status == RequestStatus.FINISHED_ABORTED and a.get_finished_reason() == "abort"
    assert sched.kv_cache_manager.usage == 0 and not sched.running and not sched.waiting
    assert sched.get_num_unfinished_requests() == 0
    so = sched.schedule()
    assert so.finished_req_ids == {"a", "b"} and so.is_empty
    assert sched.schedule().finished_req_ids == set()
    with pytest.raises(ValueError, match="FINISHED"):
        sched.finish_requests("a", RequestStatus.RUNNING)


def test_finish_between_schedule_and_update_is_harmless():
    sched = make_scheduler()
    sched.add_request(make_request("a", 4))
    sched.add_request(make_request("b", 4))
    so = sched.schedule()
    sched.finish_requests("a", RequestStatus.FINISHED_STOPPED)
    outs = sched.update_from_output(so, {"a": [1], "b": [1]})
    assert [o.request_id for o in outs] == ["b"]


def test_add_request_refuses_what_can_never_run():
    sched = make_scheduler(num_blocks=5, block_size=4, max_model_len=32)  # 16 KV slots
    ok = make_request("ok", 4, max_tokens=4)
    sched.add_request(ok)
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add_request(make_request("long", 32))
    with pytest.raises(ValueError, match="KV cache"):
        sched.add_request(make_request("big", 10, max_tokens=8))  # 17 slots > 16
    sched.add_request(make_request("fits", 10, max_tokens=7))  # 16 slots
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("ok", 4))
    assert set(sched.requests) == {"ok", "fits"}
    run_to_completion(sched)
    assert sched.kv_cache_manager.usage == 0


def test_parallel_samples_share_prompt_blocks_in_the_same_step():
    sched = make_scheduler(block_size=4)
    prompt = list(range(100, 110))
    for i in range(3):
        sched.add_request(make_request(f"p-{i}", prompt))
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"p-0": 10, "p-1": 2, "p-2": 2}
    kvm = sched.kv_cache_manager
    shared = kvm.req_to_blocks["p-0"][:2]
    assert all(kvm.req_to_blocks[f"p-{i}"][:2] == shared for i in (1, 2))
    assert [b.ref_cnt for b in shared] == [3, 3]
    assert [r.num_computed_tokens for r in so.scheduled_new_reqs] == [0, 8, 8]


def test_second_request_hits_prompt_of_running_request():
    sched = make_scheduler(block_size=4)
    prompt = list(range(100, 109))
    sched.add_request(make_request("a", prompt))
    step(sched)
    step(sched)
    b = make_request("b", prompt)
    sched.add_request(b)
    so, outs = step(sched)
    assert so.num_scheduled_tokens["b"] == 1
    blocks = sched.kv_cache_manager.req_to_blocks
    assert blocks["a"][:2] == blocks["b"][:2] and blocks["a"][0].ref_cnt == 2
    assert {o.request_id: o.num_cached_tokens for o in outs}["b"] == 8
    stats = sched.kv_cache_manager
    assert stats.prefix_cache_queries == 18 and stats.prefix_cache_hits == 8


def test_everything_finishes_and_the_cache_checks_out():
    sched = make_scheduler(num_blocks=12, block_size=2, max_num_batched_tokens=8, max_num_seqs=4)
    for i in range(10):
        sched.add_request(make_request(i, [1, 2, 3] + [i] * (i % 5), max_tokens=6 + i % 3, eos_token_id=13))
    run_to_completion(sched, FakeRunner(sched))
    assert sched.num_preemptions_total > 0
    assert sched.kv_cache_manager.usage == 0 and not sched.has_unfinished_requests()


def test_speculative_drafts_are_scheduled_verified_and_rejected_slots_taken_back() -> None:
    """A model that repeats a cycle: the n-gram drafts hit once the cycle has been seen,
    outputs are exactly the non-speculative ones, and KV accounting is unchanged."""
    from core_helpers import FakeRunner, make_request, make_scheduler, run_to_completion

    def cyclic(rid: str, context: list[int]) -> int:
        return 1 + len(context) % 5  # 1 2 3 4 5 1 2 ...

    outputs = {}
    for k in (None, 3):
        sched = make_scheduler(num_blocks=40, block_size=4, max_model_len=64, num_speculative_tokens=k)
        reqs = [make_request(i, 6 + i, max_tokens=30, ignore_eos=True) for i in range(3)]
        for r in reqs:
            sched.add_request(r)
        runner = FakeRunner(sched)
        steps = []
        orig = sched.schedule

        def schedule(orig=orig, steps=steps):
            so = orig()
            steps.append(so)
            return so

        sched.schedule = schedule
        run_to_completion(sched, runner, sample=cyclic)
        outputs[k] = [list(r.output_token_ids) for r in reqs]
        assert all(len(o) == 30 for o in outputs[k])
        assert sched.kv_cache_manager.usage == 0
        if k is None:
            assert sched.spec_stats.num_drafts == 0
            base_steps = len(steps)
        else:
            s = sched.spec_stats
            assert s.num_drafts > 0 and s.num_accepted_tokens > 0.8 * s.num_draft_tokens
            assert all(len(d) <= 3 for so in steps for d in so.scheduled_spec_decode_tokens.values())
            assert len(steps) < base_steps / 2  # several tokens per step
    assert outputs[3] == outputs[None]


@pytest.mark.parametrize(("preempt", "radix"), itertools.product([False, True], [False, True]))
def test_blocks_filled_by_accepted_drafts_stay_cached_after_the_request(preempt: bool, radix: bool) -> None:
    """The follow-up turn (the whole sequence and more) finds every full block of the
    finished or preempted request cached (the radix tree: and its partial last block),
    with speculation as without it: a block that the last step's accepted drafts filled
    was freed unregistered (one block less; the radix tree lost the partial one too)."""
    missed = []
    for k, max_tokens in itertools.product((None, 3), range(20, 28)):
        sched = make_scheduler(num_blocks=60, block_size=4, max_model_len=64, num_speculative_tokens=k, radix=radix)
        known, follow, _ = follow_up(sched, preempt, max_tokens)
        sched.schedule()
        if follow.num_cached_tokens != (len(known) - 1 if radix else (len(known) - 1) // 4 * 4):
            missed.append((k, max_tokens, follow.num_cached_tokens, len(known)))
    assert not missed, missed


@pytest.mark.parametrize("preempt", [False, True])
def test_a_finished_requests_blocks_reach_the_tier_only_while_they_hold_their_key(preempt: bool) -> None:
    """With a KV tier, speculation and a pool so small that the next request takes the
    freed blocks: every save reads a block still holding its key (FakeRunner checks), and
    the follow-up turn's KV, from the tier where the pool lost it, is right."""
    from core_helpers import FakeTier

    for max_tokens in range(20, 28):
        sched = make_scheduler(num_blocks=12, block_size=4, max_model_len=40, num_speculative_tokens=3,
                               tier=FakeTier())
        _, follow, runner = follow_up(sched, preempt, max_tokens, filler=make_request(2, 30, max_tokens=1))
        run_to_completion(sched, runner, sample=cyclic)  # (the runner checks every slot it reads)
        assert follow.num_cached_tokens > 0


def cyclic(rid: str, context: list[int]) -> int:
    return 1 + len(context) % 5  # 1 2 3 4 5 1 2 ...: n-gram drafts are accepted


def follow_up(sched, preempt: bool, max_tokens: int, filler=None):
    """Run a cyclic request to its end (or preempt it after its last step), run `filler`,
    then add its whole sequence and one more token as a new request: (the sequence, it,
    the runner holding their KV)."""
    runner, first = FakeRunner(sched), make_request(0, 7, max_tokens=max_tokens, ignore_eos=True)
    sched.add_request(first)
    if preempt:  # its blocks go as a preemption's do, after its last step settled the drafts
        while first.num_tokens < 7 + max_tokens - 1:
            so = sched.schedule()
            sched.update_from_output(so, runner.execute(so, cyclic))
        sched.kv_cache_manager.preempt(first)
        known = list(first.all_token_ids)
        sched.finish_requests(first.request_id, RequestStatus.FINISHED_ABORTED)
    else:
        run_to_completion(sched, runner, sample=cyclic)
        known = list(first.all_token_ids)
    if filler is not None:
        sched.add_request(filler)
        run_to_completion(sched, runner, sample=cyclic)
    follow = make_request(1, known + [1], max_tokens=1)
    sched.add_request(follow)
    return known, follow, runner


def test_at_most_max_loras_adapters_run_at_once_and_the_others_keep_their_place():
    from pagedserve.lora.request import LoRARequest

    sched = make_scheduler(max_loras=2)
    loras = [LoRARequest(f"a{i}", i + 1, f"/adapters/{i}") for i in range(3)]
    reqs = [make_request(i, 6, max_tokens=3) for i in range(6)]
    for r, lora in zip(reqs, [loras[0], None, loras[1], loras[2], loras[0], None], strict=True):
        r.lora_request = lora
        sched.add_request(r)
    so, _ = step(sched)
    # a2 would be a third adapter: it waits, and the requests behind it still run.
    assert list(so.num_scheduled_tokens) == ["0", "1", "2", "4", "5"]
    assert [n.lora_request for n in so.scheduled_new_reqs] == [loras[0], None, loras[1], loras[0], None]
    while sched.requests and "3" not in so.num_scheduled_tokens:
        so, _ = step(sched)
    assert "3" in so.num_scheduled_tokens  # once a0 or a1 has left
    running = {r.lora_request.lora_int_id for r in sched.running if r.lora_request is not None}
    assert len(running) <= 2


def test_the_adapter_keys_the_block_hashes_and_no_client_salt_can_equal_it():
    from pagedserve.core.request import Request
    from pagedserve.lora.request import LoRARequest

    lora = LoRARequest("a", 1, "/adapters/a")
    plain, salted = Request("x", [1] * 8), Request("y", [1] * 8, cache_salt="s")
    adapted = Request("z", [1] * 8, lora_request=lora)
    both = Request("w", [1] * 8, cache_salt="s", lora_request=lora)
    forged = Request("v", [1] * 8, cache_salt=repr((None, 1, "a", "/adapters/a")))
    # (another adapter under a freed id 1 is another key: it was served the first one's blocks)
    other = Request("u", [1] * 8, lora_request=LoRARequest("b", 1, "/adapters/b"))
    salts = [r.hash_salt for r in (plain, salted, adapted, both, forged, other)]
    assert salts[0] is None and salts[1] == "s" and salts[2] == (None, 1, "a", "/adapters/a")
    assert salts[3] == ("s", 1, "a", "/adapters/a") and salts[5] == (None, 1, "b", "/adapters/b")
    from pagedserve.core.kv_cache_utils import hash_request_tokens

    chains = [tuple(hash_request_tokens([1] * 8, 4, salt)) for salt in salts]
    assert len(set(chains)) == len(chains)


@pytest.mark.parametrize("radix", [False, True])
def test_a_stop_inside_accepted_drafts_leaves_no_kv_counted_past_the_tokens(radix: bool) -> None:
    """EOS (past min_tokens) among a step's accepted drafts ends the request there: the
    drafts after it were counted computed, so the request held KV past its tokens, and
    the radix tree, keeping its last block, read a block hash that did not exist (an
    IndexError on the engine thread: `benchmarks/prefix_reuse.py` died on it)."""
    from core_helpers import FakeRunner, make_request, make_scheduler, run_to_completion

    def cyclic(rid: str, context: list[int]) -> int:
        return 1 + len(context) % 5  # 1 2 3 4 5 1 2 ...

    accepted = 0
    for prompt_len, min_tokens in itertools.product(range(6, 10), range(12, 17)):  # each offset of the stop
        sched = make_scheduler(num_blocks=40, block_size=4, max_model_len=64, num_speculative_tokens=3, radix=radix)
        req = make_request(0, prompt_len, max_tokens=40, eos_token_id=3, min_tokens=min_tokens)
        sched.add_request(req)
        counted = []
        orig = sched.update_from_output

        def update(so, sampled, orig=orig, req=req, counted=counted):
            outs = orig(so, sampled)
            counted.append((req.num_computed_tokens, req.num_tokens))
            return outs

        sched.update_from_output = update
        run_to_completion(sched, FakeRunner(sched), sample=cyclic)
        assert req.output_token_ids[-1] == 3 and len(req.output_token_ids) >= min_tokens
        accepted += sched.spec_stats.num_accepted_tokens
        assert all(computed < tokens for computed, tokens in counted), counted
        assert sched.kv_cache_manager.usage == 0
    assert accepted > 0


def test_drafts_leave_every_later_running_request_a_token() -> None:
    """Under a tight budget (a step-time target's), the first streams' drafts took it all
    and later streams got no token for many steps; drafts now take what is left once each
    later running request has one."""
    def cyclic(rid: str, context: list[int]) -> int:
        return 1 + len(context) % 5

    sched = make_scheduler(num_blocks=80, block_size=4, max_model_len=64, num_speculative_tokens=8,
                           max_num_batched_tokens=12)
    reqs = [make_request(i, 6, max_tokens=40, ignore_eos=True) for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    runner, starved, drafted = FakeRunner(sched), 0, 0
    while sched.has_unfinished_requests():
        so = sched.schedule()
        decoding = [r.request_id for r in sched.running if r.num_output_tokens > 0]
        starved += sum(so.num_scheduled_tokens.get(rid, 0) == 0 for rid in decoding)
        drafted += sum(len(d) for d in so.scheduled_spec_decode_tokens.values())
        sched.update_from_output(so, runner.execute(so, cyclic))
    assert drafted > 0 and starved == 0
    assert all(len(r.output_token_ids) == 40 for r in reqs)

"""Async (overlap) scheduling in the core: step N+1 is scheduled before step N's
tokens are processed, which happens one step late.

The fake runner here models a device: it knows the tokens it sampled at once (as a
GPU's buffers do), so it can run a request one token past what the host knows, and
it checks that the host's deltas, arriving a step late, agree.  It writes and reads
the KV cache in launch order (a device stream), and when a step's results are
fetched it checks that no finished request's blocks were freed while that step
was still in flight.
"""

from __future__ import annotations

import pytest
from core_helpers import check_kv, make_request, make_scheduler, write_kv
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedserve.core.async_scheduler import AsyncScheduler
from pagedserve.core.request import Request, RequestStatus
from pagedserve.core.scheduler import Scheduler
from pagedserve.sampling_params import SamplingParams
from pagedserve.utils import cdiv
from tests.hypothesis_budget import examples

VOCAB = 21


def sample(rid: str, context: list[int]) -> int:
    return (sum(context) * 2654435761 + len(context) * 40503 + len(rid)) % VOCAB


def make_async_scheduler(**kw) -> AsyncScheduler:
    sched = make_scheduler(**kw)
    sched.scheduler_config.async_scheduling = True
    return AsyncScheduler(sched.scheduler_config, sched.kv_cache_manager)


class Launched:
    def __init__(self, so, sampled, held):
        self.so, self.sampled, self.held = so, sampled, held


class DeviceRunner:
    def __init__(self, scheduler: Scheduler) -> None:
        self.sched = scheduler
        self.bs = scheduler.kv_cache_manager.block_size
        self.kv: dict[int, list] = {}
        self.tables: dict[str, list[int]] = {}
        self.tokens: dict[str, list[int]] = {}  # the device's truth: host tokens + its own samples
        self.host_len: dict[str, int] = {}  # how many of them the host has sent
        self.computed: dict[str, int] = {}
        self.prev: dict[str, int] = {}  # tokens sampled by the previous launched step
        self.num_pending_reads = 0

    def launch(self, so) -> Launched:
        for rid in so.finished_req_ids | so.preempted_req_ids:
            for d in (self.tables, self.tokens, self.host_len, self.computed):
                d.pop(rid, None)
        for nr in so.scheduled_new_reqs:
            self.tables[nr.req_id] = list(nr.block_ids)
            self.tokens[nr.req_id] = list(nr.prompt_token_ids) + list(nr.output_token_ids)
            self.host_len[nr.req_id] = len(self.tokens[nr.req_id])
            self.computed[nr.req_id] = nr.num_computed_tokens
        c = so.scheduled_cached_reqs
        for i, rid in enumerate(c.req_ids):
            toks, h = self.tokens[rid], self.host_len[rid]
            new = c.new_token_ids[i]
            assert toks[h:h + len(new)] == new, f"{rid}: the host's late tokens disagree with the device's"
            self.host_len[rid] = h + len(new)
            self.tables[rid].extend(c.new_block_ids[i])
            assert c.num_computed_tokens[i] == self.computed[rid]
        bs, kv, pool = self.bs, self.kv, self.sched.kv_cache_manager.block_pool
        for rid, n in so.num_scheduled_tokens.items():
            toks, table, start = self.tokens[rid], self.tables[rid], self.computed[rid]
            assert n > 0 and start + n <= len(toks), (rid, start, n, len(toks))
            if start + n > self.host_len[rid]:  # a token only the device knows: last step's sample
                assert start + n == self.host_len[rid] + 1 and rid in self.prev, rid
                self.num_pending_reads += 1
            write_kv(kv, pool, table, toks, start, n, bs)
        sampled: dict[str, list[int]] = {}
        for rid, n in so.num_scheduled_tokens.items():
            toks, table = self.tokens[rid], self.tables[rid]
            end = self.computed[rid] + n
            check_kv(kv, table, toks, end, bs, rid)
            self.computed[rid] = end
            if end == len(toks):
                tok = sample(rid, toks)
                toks.append(tok)
                sampled[rid] = [tok]
        self.prev = {rid: t[0] for rid, t in sampled.items()}
        held = {rid: (self.sched.requests[rid], list(self.tables[rid]), self.sched.requests[rid].num_preemptions)
                for rid in so.num_scheduled_tokens}
        return Launched(so, sampled, held)

    def get_output(self, step: Launched) -> dict[str, list[int]]:
        """The step completes now: a request that finished meanwhile still holds its blocks."""
        kvm = self.sched.kv_cache_manager
        for rid, (req, table, preemptions) in step.held.items():
            if req.is_finished() and req.num_preemptions == preemptions:
                assert kvm.get_block_ids(rid)[: len(table)] == table, f"{rid}'s blocks freed while in flight"
                assert all(kvm.block_pool.blocks[b].ref_cnt >= 1 for b in table)
        return step.sampled


class Loop:
    """What the engine does: schedule and launch N+1, then process N."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched, self.runner, self.inflight = sched, DeviceRunner(sched), None
        self.outputs = []

    def step(self):
        so = self.sched.schedule()
        prev, self.inflight = self.inflight, None
        if so.total_num_scheduled_tokens:
            self.inflight = self.runner.launch(so)
        elif so.finished_req_ids:
            self.runner.launch(so)
        outs = self._process(prev) if prev else []
        if self.inflight is not None and not self.sched.has_unfinished_requests():
            outs += self._process(self.inflight)
            self.inflight = None
        return outs

    def _process(self, step: Launched):
        outs = self.sched.update_from_output(step.so, self.runner.get_output(step))
        self.outputs.extend(outs)
        return outs

    def run(self, max_steps: int = 10_000):
        for _ in range(max_steps):
            if not self.sched.has_unfinished_requests() and self.inflight is None:
                return self.outputs
            self.step()
        raise AssertionError("requests did not finish")


def expected_outputs(req: Request, max_model_len: int) -> list[int]:
    """What the request generates no matter how it is scheduled."""
    toks, out = list(req.prompt_token_ids), []
    stops = set(req.finish_token_ids)
    cap = min(max_model_len, req.num_prompt_tokens + req.max_tokens) if req.max_tokens else max_model_len
    while True:
        tok = sample(req.request_id, toks)
        toks.append(tok)
        out.append(tok)
        if (tok in stops and len(out) >= req.min_tokens) or len(toks) >= cap:
            return out


# ---------------------------------------------------------------------- unit tests
def test_outputs_match_and_everything_is_freed():
    sched = make_async_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=32, max_model_len=64)
    reqs = [make_request(i, 5 + 3 * i, max_tokens=4 + i, stop_token_ids=[3], eos_token_id=0) for i in range(6)]
    for r in reqs:
        sched.add_request(r)
    loop = Loop(sched)
    loop.run()
    for r in reqs:
        assert r.output_token_ids == expected_outputs(r, 64) and r.is_finished()
        assert r.num_output_placeholders in (0, 1)  # 1: stopped one step late, its extra token dropped
    assert sched.kv_cache_manager.usage == 0 and sched.num_deferred_frees == 0 and sched.num_inflight_steps == 0
    assert loop.runner.num_pending_reads > 0


def test_max_tokens_1_is_not_scheduled_again():
    sched = make_async_scheduler()
    req = make_request(0, 7, max_tokens=1)
    sched.add_request(req)
    so1 = sched.schedule()
    assert so1.num_scheduled_tokens == {"0": 7} and req.num_output_placeholders == 1
    so2 = sched.schedule()  # the prefill's token completes the request: nothing to do
    assert so2.num_scheduled_tokens == {}
    outs = sched.update_from_output(so1, {"0": [9]})
    assert outs[0].finished and outs[0].finish_reason == "length" and req.output_token_ids == [9]
    assert sched.kv_cache_manager.usage == 0


def test_stop_one_step_late_drops_the_extra_token_and_defers_the_free():
    sched = make_async_scheduler()
    req = make_request(0, 6, max_tokens=10, eos_token_id=5)
    sched.add_request(req)
    so1 = sched.schedule()
    so2 = sched.schedule()  # decodes the token step 1 samples, before the host knows it
    assert so2.num_scheduled_tokens == {"0": 1} and req.num_output_placeholders == 2
    assert so2.scheduled_cached_reqs.new_token_ids == [[]]
    outs = sched.update_from_output(so1, {"0": [5]})  # EOS
    assert outs[0].finished and req.status == RequestStatus.FINISHED_STOPPED
    assert sched.kv_cache_manager.get_block_ids("0"), "freed while step 2 still uses the blocks"
    assert sched.update_from_output(so2, {"0": [8]}) == []
    assert req.output_token_ids == [5] and sched.kv_cache_manager.usage == 0
    assert sched.schedule().finished_req_ids == {"0"}


def test_abort_while_in_flight_and_id_reuse():
    sched = make_async_scheduler()
    sched.add_request(make_request("a", 6, max_tokens=10))
    so1 = sched.schedule()
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert sched.kv_cache_manager.get_block_ids("a")  # deferred
    again = make_request("a", [50, 51, 52], max_tokens=3)
    sched.add_request(again)  # the old blocks go now (the device runs steps in order)
    assert sched.kv_cache_manager.get_block_ids("a") == []
    so2 = sched.schedule()
    assert so2.scheduled_new_reqs[0].req_id == "a" and len(so2.scheduled_new_reqs[0].block_ids) == 1
    # Step 1's token belonged to the aborted request, not to the new one with the same id.
    assert sched.update_from_output(so1, {"a": [4]}) == []
    assert again.output_token_ids == [] and again.num_output_placeholders == 1
    outs = sched.update_from_output(so2, {"a": [6]})
    assert outs[0].new_token_ids == [6] and again.output_token_ids == [6]


def test_results_out_of_order_are_refused():
    sched = make_async_scheduler()
    sched.add_request(make_request(0, 6))
    so1 = sched.schedule()
    so2 = sched.schedule()
    with pytest.raises(RuntimeError, match="in the order"):
        sched.update_from_output(so2, {})
    sched.update_from_output(so1, {"0": [1]})
    with pytest.raises(RuntimeError, match="once each"):
        sched.update_from_output(so1, {"0": [1]})


def test_preempted_with_a_sample_in_flight_keeps_it():
    # Two requests, blocks for barely one: the newer is preempted while its token is in flight.
    sched = make_async_scheduler(num_blocks=5, block_size=4, max_num_batched_tokens=64, max_model_len=32)
    a, b = make_request(0, 7, max_tokens=8), make_request(1, 7, max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    loop = Loop(sched)
    loop.run()
    assert sched.num_preemptions_total > 0
    for r in (a, b):
        assert r.output_token_ids == expected_outputs(r, 32)
    assert sched.kv_cache_manager.usage == 0


def test_sync_scheduling_is_unchanged_by_placeholder_logic():
    sched = make_scheduler()
    sched.add_request(make_request(0, 6, max_tokens=2))
    so = sched.schedule()
    sched.update_from_output(so, {"0": [4]})
    assert sched.requests["0"].num_output_placeholders == 0 and sched.num_inflight_steps == 0


# ------------------------------------------------------------- stateful machine
@st.composite
def configs(draw):
    max_model_len = draw(st.integers(6, 40))
    chunked = draw(st.booleans())
    return dict(
        num_blocks=draw(st.integers(3, 30)),
        block_size=draw(st.sampled_from([1, 2, 4])),
        max_num_seqs=draw(st.integers(1, 6)),
        max_num_batched_tokens=draw(st.integers(max_model_len if not chunked else 1, 48)),
        max_model_len=max_model_len,
        long_prefill_token_threshold=draw(st.sampled_from([0, 0, 1, 3, 8])),
        enable_chunked_prefill=chunked,
        policy=draw(st.sampled_from(["fcfs", "priority"])),
        enable_caching=draw(st.booleans()),
    )


request_params = st.fixed_dictionaries(dict(
    max_tokens=st.one_of(st.none(), st.integers(1, 12)), min_tokens=st.integers(0, 2),
    stop_token_ids=st.lists(st.integers(1, VOCAB - 1), max_size=2), ignore_eos=st.booleans()))


class AsyncSchedulerMachine(RuleBasedStateMachine):
    @initialize(cfg=configs())
    def setup(self, cfg):
        self.cfg = cfg
        self.sched = make_async_scheduler(**cfg)
        self.kvm = self.sched.kv_cache_manager
        self.loop = Loop(self.sched)
        self.added: dict[str, Request] = {}
        self.aborted: set[str] = set()
        self.next_id = 0

    @rule(prefix=st.sampled_from([[], [1, 2, 3, 4, 5, 6, 7, 8], [11] * 12]),
          suffix=st.lists(st.integers(0, VOCAB - 1), max_size=12), params=request_params,
          priority=st.integers(-1, 1), eos=st.sampled_from([None, 0]), copies=st.integers(1, 2))
    def add(self, prefix, suffix, params, priority, eos, copies):
        params = dict(params)
        if params["max_tokens"] is not None:
            params["min_tokens"] = min(params["min_tokens"], params["max_tokens"])
        prompt = (prefix + suffix) or [3]
        cfg = self.cfg
        for _ in range(copies):
            rid = f"r{self.next_id}"
            self.next_id += 1
            req = Request(rid, prompt, SamplingParams(**params), eos_token_id=eos, arrival_time=float(self.next_id),
                          priority=priority)
            max_len = cfg["max_model_len"]
            if params["max_tokens"] is not None:
                max_len = min(max_len, len(prompt) + params["max_tokens"])
            fits = len(prompt) < cfg["max_model_len"] and cdiv(max_len - 1, cfg["block_size"]) <= cfg["num_blocks"] - 1
            try:
                self.sched.add_request(req)
            except ValueError:
                assert not fits
                continue
            self.added[rid] = req

    @rule()
    def step(self):
        for out in self.loop.step():
            req = self.added[out.request_id]
            assert req.output_token_ids[-len(out.new_token_ids):] == out.new_token_ids
            assert out.finished == req.is_finished()
            all_ids, p = req.all_token_ids, req.num_prompt_tokens
            for i, tok in enumerate(req.output_token_ids):
                assert tok == sample(req.request_id, all_ids[: p + i])

    @precondition(lambda self: bool(self.sched.requests))
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.sched.requests)))
        self.sched.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
        self.aborted.add(rid)

    @invariant()
    def blocks_are_consistent(self):
        """The manager's own invariants, then the deferred frees: a finished request keeps
        its blocks only while a step that wrote them is in flight."""
        if not hasattr(self, "sched"):
            return
        sched, kvm = self.sched, self.kvm
        kvm.check_invariants()
        num_finished_holders = 0
        for rid in kvm.req_to_blocks:
            request = sched.requests.get(rid)
            if request is None or request.is_finished():  # blocks kept for an in-flight step
                num_finished_holders += 1
            else:
                assert request.status == RequestStatus.RUNNING
        assert num_finished_holders == sched.num_deferred_frees
        assert sched.num_inflight_steps <= 1
        for r in sched.waiting:
            assert r.num_computed_tokens == 0 and r.request_id not in kvm.req_to_blocks
        assert all(r.status == RequestStatus.RUNNING for r in sched.running)

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        self.loop.run(3000)
        assert self.kvm.usage == 0 and self.kvm.req_to_blocks == {} and self.sched.num_deferred_frees == 0
        for rid, req in self.added.items():
            assert req.is_finished()
            if rid not in self.aborted:
                assert req.output_token_ids == expected_outputs(req, self.cfg["max_model_len"]), req


AsyncSchedulerMachine.TestCase.settings = settings(
    max_examples=examples(150), stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestAsyncSchedulerMachine = AsyncSchedulerMachine.TestCase

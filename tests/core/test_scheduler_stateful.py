"""Random add / step / abort sequences against the scheduler, with the fake runner
checking KV contents and the invariants checked after every step."""

from __future__ import annotations

from core_helpers import FakeRunner, FakeTier, make_scheduler
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedserve.core.block_pool import group_block_key
from pagedserve.core.request import Request, RequestStatus
from pagedserve.core.single_type_kv_cache_manager import first_block_in_window, max_blocks_held
from pagedserve.core.snapshot import block_state
from pagedserve.sampling_params import SamplingParams
from pagedserve.utils import cdiv
from tests.hypothesis_budget import examples

PREFIXES = [[], [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9, 9, 9], [11] * 12]
VOCAB = 21  # small, so EOS (0) and stop ids come up by chance


def sample(rid: str, context: list[int]) -> int:
    return (sum(context) * 2654435761 + len(context) * 40503 + len(rid)) % VOCAB


@st.composite
def configs(draw):
    max_model_len = draw(st.integers(6, 40))
    chunked = draw(st.booleans())
    budget = draw(st.integers(max_model_len if not chunked else 1, 48))
    return dict(
        num_blocks=draw(st.integers(3, 30)),
        block_size=draw(st.sampled_from([1, 2, 4])),
        max_num_seqs=draw(st.integers(1, 6)),
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        long_prefill_token_threshold=draw(st.sampled_from([0, 0, 1, 3, 8])),
        enable_chunked_prefill=chunked,
        policy=draw(st.sampled_from(["fcfs", "priority"])),
        enable_caching=draw(st.booleans()),
        num_speculative_tokens=draw(st.sampled_from([None, None, 1, 3])),
        # KV-cache groups: one full-attention group (dense models), or hybrid ones with
        # sliding windows of a few tokens (Gemma 3's shape), or one sliding group (Mistral).
        group_windows=draw(st.sampled_from([(None,), (None,), (None, 3), (None, 2, 2), (5,)])),
        # The KV tier beneath the pool (one full-attention group only), of a few entries
        # or plenty, and whether preemption swaps to it.
        tier=draw(st.sampled_from([None, None, "tier", "swap", "swap-only"])),
        tier_capacity=draw(st.sampled_from([2, 8, 1000])),
        radix=draw(st.booleans()),
    )


request_params = st.fixed_dictionaries(
    dict(
        max_tokens=st.one_of(st.none(), st.integers(1, 12)),
        min_tokens=st.integers(0, 2),
        stop_token_ids=st.lists(st.integers(1, VOCAB - 1), max_size=2),
        ignore_eos=st.booleans(),
    )
)


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(cfg=configs())
    def setup(self, cfg):
        self.cfg = cfg
        cfg = dict(cfg)
        mode, capacity = cfg.pop("tier"), cfg.pop("tier_capacity")
        cfg["radix"] = cfg["radix"] and cfg["enable_caching"] and cfg["group_windows"] == (None,)
        if mode is not None and cfg["group_windows"] == (None,):
            cfg["tier"] = FakeTier(capacity)
            cfg["preemption_mode"] = "recompute" if mode == "tier" else "swap"
            cfg["store_computed"] = mode != "swap-only"  # a tier for swapping only
        self.sched = make_scheduler(**cfg)
        self.kvm = self.sched.kv_cache_manager
        self.runner = FakeRunner(self.sched)
        self.added: dict[str, Request] = {}
        self.num_drafted = 0
        self.next_id = 0
        self.clock = 0.0
        # The dashboard's view: a full snapshot, then deltas of changed blocks only.
        self.sched.watch_blocks(True)
        self.mirror = {b[0]: b for b in self.sched.snapshot(full=True).blocks}

    def _add(self, prompt, params, priority, eos) -> None:
        params = dict(params)
        if params["max_tokens"] is not None and params["min_tokens"] > params["max_tokens"]:
            params["min_tokens"] = params["max_tokens"]
        rid = f"r{self.next_id}"
        self.next_id += 1
        self.clock += 1.0
        req = Request(rid, prompt, SamplingParams(**params), eos_token_id=eos, arrival_time=self.clock,
                      priority=priority)
        cfg = self.cfg
        max_len = cfg["max_model_len"]
        if params["max_tokens"] is not None:
            max_len = min(max_len, len(prompt) + params["max_tokens"])
        # Blocks it holds at most: every position in a full group; in a sliding group, the
        # window of a step's first query through that step's last token.
        bs, step_tokens, positions = cfg["block_size"], cfg["max_num_batched_tokens"], cdiv(max_len - 1, cfg["block_size"])
        need = sum(positions if w is None else min(positions, (w + step_tokens - 2) // bs + 2)
                   for w in cfg["group_windows"])
        fits = len(prompt) < cfg["max_model_len"] and need <= cfg["num_blocks"] - 1
        before = set(self.sched.requests)
        try:
            self.sched.add_request(req)
        except ValueError:
            assert not fits
            assert set(self.sched.requests) == before
            return
        assert fits
        self.added[rid] = req

    @rule(
        prefix=st.sampled_from(PREFIXES),
        suffix=st.lists(st.integers(0, VOCAB - 1), max_size=12),
        params=request_params,
        priority=st.integers(-1, 1),
        eos=st.sampled_from([None, 0]),
    )
    def add(self, prefix, suffix, params, priority, eos):
        prompt = (prefix + suffix) or [3]
        self._add(prompt, params, priority, eos)

    @rule(prefix=st.sampled_from(PREFIXES[1:]), n=st.integers(2, 3), params=request_params)
    def add_siblings(self, prefix, n, params):
        """What the engine does for n > 1: children with one prompt, added together."""
        for _ in range(n):
            self._add(list(prefix), params, 0, None)

    @rule()
    def step(self):
        sched, cfg = self.sched, self.cfg
        so = sched.schedule()
        total = sum(so.num_scheduled_tokens.values())
        assert total == so.total_num_scheduled_tokens <= cfg["max_num_batched_tokens"]
        assert all(n > 0 for n in so.num_scheduled_tokens.values())
        if cfg["long_prefill_token_threshold"] and cfg["enable_chunked_prefill"]:
            assert max(so.num_scheduled_tokens.values(), default=0) <= cfg["long_prefill_token_threshold"]
        assert len(sched.running) <= cfg["max_num_seqs"]
        if so.preempted_req_ids:
            assert not so.scheduled_new_reqs
        assert not (so.preempted_req_ids & set(so.num_scheduled_tokens))
        sampled = self.runner.execute(so, sample)
        outs = sched.update_from_output(so, sampled)
        self.num_drafted += sum(len(d) for d in so.scheduled_spec_decode_tokens.values())
        for out in outs:
            req = self.added[out.request_id]
            assert req.output_token_ids[-len(out.new_token_ids):] == out.new_token_ids
            assert out.finished == req.is_finished()
        for rid in so.num_scheduled_tokens:
            self._check_outputs(self.added[rid])

    @staticmethod
    def _check_outputs(req: Request) -> None:
        """Each output token is what the model gives for exactly the tokens before it,
        so a sample taken from a partial prompt can never slip in."""
        all_ids, p = req.all_token_ids, req.num_prompt_tokens
        for i, tok in enumerate(req.output_token_ids):
            assert tok == sample(req.request_id, all_ids[: p + i]), (req, i)

    @precondition(lambda self: bool(self.sched.requests))
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.sched.requests)))
        self.sched.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
        assert rid not in self.sched.requests and self.kvm.get_block_ids(rid) == []

    @precondition(lambda self: self.kvm.tier is not None and bool(self.kvm.tier.entries))
    @rule(data=st.data())
    def lose_tier_entry(self, data):
        """An entry vanishes (evicted, found damaged, removed by another server): whoever
        needed it recomputes."""
        key = data.draw(st.sampled_from(sorted(self.kvm.tier.entries)))
        del self.kvm.tier.entries[key]

    @invariant()
    def radix_nodes_are_blocks_holding_their_tokens(self):
        """Every radix node is a block no one is writing into whose KV holds, slot by
        slot, the prefix its parent key and tokens say (the fake runner's fingerprints)."""
        if not hasattr(self, "sched") or self.kvm.radix is None:
            return
        radix, pool = self.kvm.radix, self.kvm.block_pool
        for parent, kids in radix.children.items():
            for block_id, tokens in kids.items():
                assert radix.parent_of[block_id] == parent and 0 < len(tokens) <= self.kvm.block_size
                block = pool.blocks[block_id]
                assert block.ref_cnt == 0 or block.block_hash is not None, block  # partial ones are free
                slots = self.runner.kv.get(block_id)
                assert slots is not None and None not in slots[:len(tokens)], (block_id, slots)

    @invariant()
    def swapped_requests_are_preempted_ones(self):
        if not hasattr(self, "sched"):
            return
        for rid in self.kvm.swapped:
            assert self.sched.requests[rid].status == RequestStatus.PREEMPTED

    @invariant()
    def blocks_are_consistent(self):
        """The manager's own invariants, then what it cannot know: holders are running
        requests, and a shared block holds the same tokens for each of them."""
        if not hasattr(self, "sched"):
            return
        sched, kvm = self.sched, self.kvm
        kvm.check_invariants()
        positions: dict[int, set[int]] = {}
        groups = kvm.num_groups
        for rid, blocks in kvm.req_to_blocks.items():
            assert rid in sched.requests and sched.requests[rid].status == RequestStatus.RUNNING
            for idx, b in enumerate(blocks):
                if not b.is_null:
                    positions.setdefault(b.block_id, set()).add(idx)
        for block_id, held_at in positions.items():
            b = kvm.block_pool.blocks[block_id]
            if b.ref_cnt > 1:  # shared only as a cached prefix, at the same position for everyone
                (idx,) = held_at
                for rid, blocks in kvm.req_to_blocks.items():
                    if b in blocks:  # the group's key of the tokens at that position
                        key = group_block_key(sched.requests[rid].block_hashes[idx // groups], idx % groups)
                        assert key == b.block_hash

    @invariant()
    def sliding_groups_hold_their_window(self):
        """In a sliding-window group a running request holds every block the next step's
        queries read (from its window's first block on) and, before it, only released
        (null) positions: never more than the window and one step's tokens span."""
        if not hasattr(self, "sched"):
            return
        kvm, bs = self.kvm, self.kvm.block_size
        for rid, blocks in kvm.req_to_blocks.items():
            computed = self.sched.requests[rid].num_computed_tokens
            for g, w in kvm.sliding_groups:
                table = blocks[g::kvm.num_groups]
                first = first_block_in_window(computed, w, bs)
                assert all(not b.is_null for b in table[first:]), (rid, g, table)
                held = [i for i, b in enumerate(table) if not b.is_null]
                assert held == list(range(held[0], len(table))) if held else True  # nulls only lead
                assert len(held) <= max_blocks_held(len(table) * bs, bs, (w,), self.cfg["max_num_batched_tokens"] + 3)

    @invariant()
    def snapshot_deltas_keep_a_true_picture(self):
        """A watcher applying only the changed blocks sees exactly the pool's state, and
        each listed running request holds exactly the blocks its table says."""
        if not hasattr(self, "sched"):
            return
        snap = self.sched.snapshot(full=False)
        assert not snap.full
        self.mirror.update({b[0]: b for b in snap.blocks})
        assert [self.mirror[i] for i in range(snap.num_blocks)] == [block_state(b) for b in self.kvm.block_pool.blocks]
        assert snap.num_running == len(self.sched.running) and snap.num_waiting == len(self.sched.waiting)
        for row in snap.running:
            assert row.state == "running" and row.block_ids == self.kvm.get_block_ids(row.request_id)
        assert all(row.block_ids == [] for row in snap.waiting)

    @invariant()
    def queues_are_consistent(self):
        if not hasattr(self, "sched"):
            return
        sched = self.sched
        running, waiting = list(sched.running), list(sched.waiting)
        assert len(running) <= self.cfg["max_num_seqs"]
        assert {r.request_id for r in running + waiting} == set(sched.requests)
        assert len(running) + len(waiting) == len(sched.requests) == sched.get_num_unfinished_requests()
        assert all(r.status == RequestStatus.RUNNING for r in running)
        for r in waiting:
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert r.num_computed_tokens == 0 and r.request_id not in self.sched.kv_cache_manager.req_to_blocks
        if sched.policy == "priority":
            assert [r.sched_key for r in running] == sorted(r.sched_key for r in running)

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        sched = self.sched
        for _ in range(3000):
            if not sched.has_unfinished_requests():
                break
            self.step()
            self.blocks_are_consistent()
        assert not sched.has_unfinished_requests(), "requests did not finish"
        assert sched.spec_stats.num_draft_tokens == self.num_drafted  # every draft verified once
        assert self.kvm.usage == 0 and self.kvm.req_to_blocks == {}
        for req in self.added.values():
            assert req.is_finished()
            assert req.num_tokens <= self.cfg["max_model_len"]
            if req.max_tokens is not None:
                assert req.num_output_tokens <= req.max_tokens


SchedulerMachine.TestCase.settings = settings(
    max_examples=examples(400),
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestSchedulerMachine = SchedulerMachine.TestCase

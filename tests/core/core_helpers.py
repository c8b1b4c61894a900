"""Builders and a fake model runner for the core tests.

The fake runner keeps a token-level model of the paged KV cache: each slot holds a
fingerprint of the whole prefix ending at that position.  It follows the
SchedulerOutput protocol exactly as a real runner must (persistent per-request
block tables and token lists updated from deltas), writes a step's new slots
first and then checks that every slot each request attends over holds *its*
prefix, so wrong block tables, wrong deltas or a wrongly shared cached block all
fail loudly.
"""

from __future__ import annotations

import zlib

from pagedserve.config import SchedulerConfig, SpeculativeConfig
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.request import Request
from pagedserve.core.sched_output import SchedulerOutput
from pagedserve.core.scheduler import Scheduler
from pagedserve.sampling_params import SamplingParams


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 64,
    long_prefill_token_threshold: int = 0,
    enable_chunked_prefill: bool = True,
    policy: str = "fcfs",
    enable_caching: bool = True,
    max_step_ms: float | None = None,
    num_speculative_tokens: int | None = None,
    group_windows: tuple[int | None, ...] = (None,),
    tier: FakeTier | None = None,
    preemption_mode: str = "recompute",
    radix: bool = False,
    store_computed: bool = True,
    max_loras: int = 0,
) -> Scheduler:
    cfg = SchedulerConfig(
        max_step_ms=max_step_ms,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        long_prefill_token_threshold=long_prefill_token_threshold,
        enable_chunked_prefill=enable_chunked_prefill,
        policy=policy,
        preemption_mode=preemption_mode,
    )
    kvm = KVCacheManager(num_blocks, block_size, max_model_len, enable_caching=enable_caching,
                         group_windows=group_windows, tier=tier, swap=preemption_mode == "swap",
                         radix=radix, store_computed=store_computed)
    spec = None
    if num_speculative_tokens:  # n-gram drafts at any batch size
        spec = SpeculativeConfig(num_speculative_tokens=num_speculative_tokens, prompt_lookup_min=1,
                                 disable_by_batch_size=max_num_seqs)
    return Scheduler(cfg, kvm, spec, max_loras=max_loras)


def make_request(
    req_id: str | int,
    prompt: list[int] | int,
    max_tokens: int | None = 16,
    eos_token_id: int | None = None,
    arrival_time: float | None = None,
    priority: int = 0,
    **params,
) -> Request:
    if isinstance(prompt, int):
        # Distinct per request id, so that no two requests share a prefix by accident.
        k = zlib.crc32(str(req_id).encode()) % 10_000
        prompt = [(7 * i + 13 * k) % 50_000 + 10 for i in range(prompt)]
    sp = SamplingParams(max_tokens=max_tokens, **params)
    at = float(int(req_id)) if arrival_time is None and str(req_id).isdigit() else arrival_time
    return Request(str(req_id), prompt, sp, eos_token_id=eos_token_id, arrival_time=at, priority=priority)


class FakeTier:
    """The KV tier as the core sees it (core/kv_tier.py), holding the fake runner's slot
    fingerprints per key, at most `capacity` entries (least recently stored dropped)."""

    def __init__(self, capacity: int = 1_000_000) -> None:
        self.capacity = capacity
        self.entries: dict[int, list] = {}
        self.claimed: dict[int, list] = {}
        self.num_stored = 0
        self.num_invalid = 0

    def contains(self, key: int) -> bool:
        return key in self.entries

    def lookup(self, keys) -> int:
        n = 0
        while n < len(keys) and keys[n] in self.entries:
            n += 1
        return n

    def claim(self, keys) -> None:
        for key in keys:  # (two requests may load the same prefix in one step)
            self.claimed.setdefault(key, []).append(self.entries[key])

    def put(self, key: int, slots: list) -> None:
        self.entries.pop(key, None)
        self.entries[key] = list(slots)
        self.num_stored += 1
        while len(self.entries) > self.capacity:
            del self.entries[next(iter(self.entries))]

    def take(self, key: int) -> list:
        slots = self.claimed[key].pop()
        if not self.claimed[key]:
            del self.claimed[key]
        return slots


class FakeRunner:
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.block_size = scheduler.kv_cache_manager.block_size
        # KV-cache groups: tables arrive position-major over them (core/kv_cache_manager.py).
        self.group_windows = scheduler.kv_cache_manager.group_windows
        self.kv: dict[int, list] = {}
        self.tables: dict[str, list[int]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}

    def _update_states(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids | so.preempted_req_ids:
            for d in (self.tables, self.tokens, self.computed):
                d.pop(rid, None)
        for nr in so.scheduled_new_reqs:
            assert nr.req_id not in self.tables, f"{nr.req_id} sent as new while the runner holds it"
            self.tables[nr.req_id] = list(nr.block_ids)
            self.tokens[nr.req_id] = list(nr.prompt_token_ids) + list(nr.output_token_ids)
            self.computed[nr.req_id] = nr.num_computed_tokens
        c = so.scheduled_cached_reqs
        for i, rid in enumerate(c.req_ids):
            assert rid in self.tables, f"cached request {rid} unknown to the runner"
            self.tables[rid].extend(c.new_block_ids[i])
            self.tokens[rid].extend(c.new_token_ids[i])
            assert c.num_computed_tokens[i] == self.computed[rid]

    def execute(self, so: SchedulerOutput, sample) -> dict[str, list[int]]:
        """One step.  Drafts (speculative decoding) are verified as a greedy model would:
        each is kept while it equals what `sample` gives for the tokens before it, and the
        first that does not is replaced by that sample (all kept: one more sample)."""
        self._update_states(so)
        bs, kv = self.block_size, self.kv
        pool = self.scheduler.kv_cache_manager.block_pool
        tier = self.scheduler.kv_cache_manager.tier
        transfers = so.kv_transfers
        if transfers is not None:  # swap-outs before loads (a block may be both), loads before the step
            for block_id, key in transfers.swap_outs:
                tier.put(key, kv.get(block_id, [None] * bs))
            sources = [list(kv.get(src, [None] * bs)) for src, _ in transfers.copies]
            for (_, dst), slots in zip(transfers.copies, sources, strict=True):
                assert pool.blocks[dst].ref_cnt >= 1, f"copying into free block {dst}"
                kv[dst] = slots
            for block_id, key in transfers.loads:
                assert pool.blocks[block_id].ref_cnt >= 1, f"loading into free block {block_id}"
                kv[block_id] = list(tier.take(key))
            assert tier is None or not tier.claimed, "claimed tier entries not loaded"
        assert set(so.num_scheduled_tokens) == {nr.req_id for nr in so.scheduled_new_reqs} | set(
            so.scheduled_cached_reqs.req_ids
        )
        drafts = so.scheduled_spec_decode_tokens
        assert set(drafts) <= set(so.num_scheduled_tokens)
        # Write every new slot of the step first (as each attention layer does) ...
        for rid, n in so.num_scheduled_tokens.items():
            toks, table, start = self.tokens[rid] + drafts.get(rid, []), self.tables[rid], self.computed[rid]
            assert n > 0 and start + n <= len(toks), (rid, start, n, len(toks))
            if rid in drafts:  # drafts follow the last known token, which is all that is new
                assert start + n == len(toks) and n == len(drafts[rid]) + 1, (rid, start, n, len(toks))
            req = self.scheduler.requests[rid]
            assert self.tokens[rid] == req.all_token_ids[: len(self.tokens[rid])]
            groups = len(self.group_windows)
            for g in range(groups):
                write_kv(kv, pool, table[g::groups], toks, start, n, bs)
        # ... then every request reads its whole context (a sliding-window group: the
        # window of the step's first query on).
        sampled: dict[str, list[int]] = {}
        for rid, n in so.num_scheduled_tokens.items():
            d = drafts.get(rid, [])
            toks, table = self.tokens[rid] + d, self.tables[rid]
            start, end = self.computed[rid], self.computed[rid] + n
            groups = len(self.group_windows)
            for g, w in enumerate(self.group_windows):
                check_kv(kv, table[g::groups], toks, end, bs, rid, 0 if w is None else max(0, start - w + 1))
            out: list[int] = []
            for j in range(len(d) + 1):
                tok = sample(rid, toks[: end - len(d) + j])
                out.append(tok)
                if j == len(d) or d[j] != tok:
                    break
            self.computed[rid] = end - (len(d) - (len(out) - 1))
            sampled[rid] = out
        if transfers is not None:  # after the step, which computed them
            for block_id, key in transfers.saves:
                slots = kv[block_id]
                assert None not in slots, f"saving block {block_id}, not full"
                assert pool.blocks[block_id].block_hash == key, f"saving block {block_id}, handed out again"
                tier.put(key, slots)
        return sampled


def write_kv(kv: dict, pool, table: list[int], toks: list[int], start: int, n: int, bs: int) -> None:
    """Fake attention store: slot `pos` of a request gets a fingerprint of its tokens[: pos + 1]."""
    assert len(table) * bs >= start + n, "not enough blocks for the scheduled tokens"
    for pos in range(start, start + n):
        block_id = table[pos // bs]
        assert block_id != 0, "null block in a table"
        assert pool.blocks[block_id].ref_cnt >= 1, f"writing into free block {block_id}"
        kv.setdefault(block_id, [None] * bs)[pos % bs] = hash(tuple(toks[: pos + 1]))


def check_kv(kv: dict, table: list[int], toks: list[int], end: int, bs: int, rid: str, first: int = 0) -> None:
    """Fake attention read: every slot of the context (from `first`) holds the right prefix fingerprint."""
    for pos in range(first, end):
        got = kv.get(table[pos // bs], [None] * bs)[pos % bs]
        assert got == hash(tuple(toks[: pos + 1])), f"{rid}: wrong KV at position {pos}"


def default_sample(rid: str, context: list[int]) -> int:
    return (sum(context) * 31 + len(context)) % 97 + 1


def run_to_completion(sched: Scheduler, runner: FakeRunner | None = None, sample=default_sample, max_steps=10_000):
    """Drive the scheduler until no request is left; returns all EngineCoreOutputs."""
    runner = runner or FakeRunner(sched)
    outs = []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return outs
        so = sched.schedule()
        outs.extend(sched.update_from_output(so, runner.execute(so, sample)))
    raise AssertionError("requests did not finish (livelock?)")


def admit(kvm, req, num_new_tokens=None):
    """What the scheduler does for a waiting request: look up its prefix, allocate the rest."""
    blocks, hit = kvm.get_computed_blocks(req)
    n = num_new_tokens if num_new_tokens is not None else req.num_tokens - hit
    new = kvm.allocate_slots(req, n, hit, blocks)
    if new is not None:
        req.num_computed_tokens = hit + n
    return new, hit

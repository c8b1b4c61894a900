"""Micro-benchmark: CPU time of Scheduler + KVCacheManager per engine step (no model).

    python -m pagedserve.benchmarks.bench_scheduler [--steps N] [--profile]

Scenarios: (1) 256 running requests all decoding; (2) mixed steps where decodes
share the budget with a long prompt being prefilled in chunks, new requests
arriving (half of them sharing a system prompt) and old ones finishing.  The
model runner is replaced by a constant token, so the figures are the pure
scheduling overhead an engine step pays on the host.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import statistics
import time

from pagedserve.config import SchedulerConfig
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.request import Request
from pagedserve.core.scheduler import Scheduler
from pagedserve.sampling_params import SamplingParams


def _make(num_blocks: int, block_size: int, max_num_seqs: int, budget: int, max_model_len: int) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len)
    return Scheduler(cfg, KVCacheManager(num_blocks, block_size, max_model_len))


def _step(sched: Scheduler) -> tuple[int, int, int]:
    t0 = time.perf_counter_ns()
    so = sched.schedule()
    t1 = time.perf_counter_ns()
    sampled = {rid: [7] for rid in so.num_scheduled_tokens}
    t2 = time.perf_counter_ns()
    sched.update_from_output(so, sampled)
    t3 = time.perf_counter_ns()
    return t1 - t0, t3 - t2, so.total_num_scheduled_tokens


def bench_decode(steps: int, num_reqs: int = 256, prompt_len: int = 512, block_size: int = 16) -> dict:
    max_model_len = 4096
    sched = _make(num_reqs * (prompt_len + steps + 64) // block_size + 16, block_size, num_reqs, 8192, max_model_len)
    rng = random.Random(0)
    for i in range(num_reqs):
        prompt = [rng.randrange(32000) for _ in range(prompt_len)]
        sched.add_request(Request(f"req-{i}", prompt, SamplingParams(max_tokens=None, ignore_eos=True)))
    while len(sched.waiting) or any(r.num_computed_tokens < r.num_tokens - 1 for r in sched.running):
        _step(sched)  # prefill everything first
    assert len(sched.running) == num_reqs
    return _measure(sched, steps)


def bench_mixed(steps: int, block_size: int = 16) -> dict:
    """~200 decodes share each 4096-token budget with chunks of 6k-token prompts.

    Decoding requests finish and are replaced (their prompts, half of them behind a
    shared 1k-token system prompt, are prefilled in the same steps); a new long
    prompt starts as soon as the previous one is done.
    """
    max_model_len = 8192
    sched = _make(40_000, block_size, 256, 4096, max_model_len)
    rng = random.Random(1)
    system_prompt = [rng.randrange(32000) for _ in range(1024)]
    counter = 0

    def add(prompt_len: int, max_tokens: int, shared: bool) -> None:
        nonlocal counter
        prefix = system_prompt if shared else []
        prompt = prefix + [rng.randrange(32000) for _ in range(prompt_len - len(prefix))]
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        sched.add_request(Request(f"req-{counter}", prompt, sp))
        counter += 1

    def refill() -> None:
        if not any(r.max_tokens == 1 for r in sched.requests.values()):
            add(6000, 1, shared=False)
        while len(sched.requests) < 201:
            add(rng.randrange(1100, 1500), rng.randrange(100, 400), shared=counter % 2 == 0)

    for _ in range(50):
        refill()
        _step(sched)
    return _measure(sched, steps, refill)


def _measure(sched: Scheduler, steps: int, before_step=None) -> dict:
    """Median per-step times: robust to other processes stealing the CPU mid-run."""
    sched_t, update_t = [], []
    tokens = reqs = 0
    for _ in range(steps):
        if before_step is not None:
            before_step()
        reqs += len(sched.running)
        s, u, t = _step(sched)
        sched_t.append(s)
        update_t.append(u)
        tokens += t
    kvm = sched.kv_cache_manager
    total = sorted(a + b for a, b in zip(sched_t, update_t, strict=True))
    return {
        "schedule_ms": statistics.median(sched_t) / 1e6,
        "update_ms": statistics.median(update_t) / 1e6,
        "total_ms": statistics.median(total) / 1e6,
        "p90_ms": total[int(0.9 * (len(total) - 1))] / 1e6,
        "tokens_per_step": tokens / steps,
        "running_per_step": reqs / steps,
        "kv_usage": kvm.usage,
        "prefix_hit_rate": kvm.prefix_cache_hit_rate,
        "preemptions": sched.num_preemptions_total,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--profile", action="store_true", help="print the top functions by own time")
    args = parser.parse_args()
    for name, fn in (("decode (256 running)", bench_decode), ("mixed prefill/decode", bench_mixed)):
        prof = cProfile.Profile() if args.profile else None
        if prof:
            prof.enable()
        r = fn(args.steps)
        if prof:
            prof.disable()
        print(
            f"{name:22s}: median schedule {r['schedule_ms']:.3f} ms + update {r['update_ms']:.3f} ms; "
            f"step {r['total_ms']:.3f} ms (p90 {r['p90_ms']:.3f})  ({r['running_per_step']:.0f} running, "
            f"{r['tokens_per_step']:.0f} tokens/step, kv usage {r['kv_usage']:.2f}, "
            f"prefix hit rate {r['prefix_hit_rate']:.2f}, preemptions {r['preemptions']})"
        )
        if prof:
            pstats.Stats(prof).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()

"""Data-parallel routing: prefix-cache hit rate and time by router policy.

    python -m pagedserve.benchmarks.bench_router [--model M] [--data-parallel-size 2]
        [--policies round_robin,least_loaded,cache_aware] [--num-blocks 40] [-- SERVER FLAGS...]

For each policy, starts `pagedserve serve --data-parallel-size N --router-policy P` (a
local Ray), sends one shared-prefix workload and reads the prefix-cache counters of
every replica from /metrics.  The workload: `--prefixes` distinct "system prompts" of
`--prefix-len` tokens, each request one of them (in a seeded random order) followed by
`--suffix-len` tokens of its own, `--requests` requests, `--concurrency` at a time.
Token-id prompts, so any model serves it.  `--num-blocks` sizes each replica's KV cache
(blocks of 16): small enough that a replica cannot keep every system prompt, which is
where sending a prompt to the replica that holds its prefix pays.

Prints, per policy: prefix-cache hit rate (hits / queries, in tokens, over the run),
requests each replica got, affinity hits, and wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from dataclasses import dataclass

import httpx

from pagedserve.benchmarks.harness import PagedServe, metric_samples
from pagedserve.cpu_info import describe_cpu
from pagedserve.engine.arg_utils import DEFAULT_MODEL


def shared_prefix_workload(num_prefixes: int, prefix_len: int, suffix_len: int, num_requests: int,
                           vocab: tuple[int, int], seed: int = 0) -> list[list[int]]:
    """Token-id prompts: one of `num_prefixes` fixed prefixes (chosen at random for each
    request, so no policy gets a lucky order) plus a suffix of its own; ids drawn from
    [vocab[0], vocab[1])."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(*vocab) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    return [rng.choice(prefixes) + [rng.randrange(*vocab) for _ in range(suffix_len)] for _ in range(num_requests)]


@dataclass
class RouterRun:
    hit_rate: float  # prefix-cache hits / queries (tokens), summed over replicas, over the run
    requests: dict[str, float]  # engine label -> requests the router sent it
    affinity_hits: float
    seconds: float
    texts: list[str]


def cache_counters(url: str, headers: dict[str, str] | None = None) -> dict[str, dict[str, float]]:
    """{sample name: {engine label: value}} of the series this benchmark reads."""
    wanted = {"vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total", "pagedserve:router_requests_total",
              "pagedserve:router_affinity_hits_total"}
    samples = metric_samples(httpx.get(url + "/metrics", timeout=10, headers=headers).text)
    return {name: {labels.get("engine", "0"): value for labels, value in samples.get(name, [])} for name in wanted}


async def _send_all(url: str, model: str, prompts: list[list[int]], max_tokens: int, concurrency: int,
                    headers: dict[str, str] | None) -> list[str]:
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=300, headers=headers) as client:
        async def one(prompt: list[int]) -> str:
            async with gate:
                r = await client.post(url + "/v1/completions", json={
                    "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                    "ignore_eos": True})
                if r.status_code != 200:
                    raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
                return r.json()["choices"][0]["text"]

        return list(await asyncio.gather(*(one(p) for p in prompts)))


def run_workload(url: str, model: str, prompts: list[list[int]], max_tokens: int = 4, concurrency: int = 1,
                 headers: dict[str, str] | None = None) -> RouterRun:
    """Send the prompts, waiting for the replicas' statistics to reach /metrics (they are
    polled every 0.1 s) before reading the counters after the run."""
    before = cache_counters(url, headers)
    t0 = time.perf_counter()
    texts = asyncio.run(_send_all(url, model, prompts, max_tokens, concurrency, headers))
    seconds = time.perf_counter() - t0
    time.sleep(0.5)
    after = cache_counters(url, headers)

    def delta(name: str) -> dict[str, float]:
        return {e: v - before[name].get(e, 0.0) for e, v in after[name].items()}

    queries = sum(delta("vllm:prefix_cache_queries_total").values())
    hits = sum(delta("vllm:prefix_cache_hits_total").values())
    return RouterRun(hits / queries if queries else 0.0, delta("pagedserve:router_requests_total"),
                     sum(delta("pagedserve:router_affinity_hits_total").values()), seconds, texts)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--data-parallel-size", type=int, default=2)
    p.add_argument("--policies", default="round_robin,least_loaded,cache_aware")
    p.add_argument("--prefixes", type=int, default=4)
    p.add_argument("--prefix-len", type=int, default=160)
    p.add_argument("--suffix-len", type=int, default=16)
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--num-blocks", type=int, default=40, help="KV blocks per replica (num_gpu_blocks_override)")
    p.add_argument("--vocab", type=int, default=200, help="prompt token ids are drawn from [10, VOCAB)")
    p.add_argument("server_flags", nargs=argparse.REMAINDER, help="further `pagedserve serve` flags, after --")
    args = p.parse_args(argv)
    extra = [f for f in args.server_flags if f != "--"]
    prompts = shared_prefix_workload(args.prefixes, args.prefix_len, args.suffix_len, args.requests,
                                     (10, args.vocab))
    print(f"CPU: {describe_cpu()}; model {args.model}; {args.data_parallel_size} replicas, "
          f"{args.num_blocks} KV blocks each; {args.requests} requests over {args.prefixes} prefixes of "
          f"{args.prefix_len} tokens (+{args.suffix_len}), concurrency {args.concurrency}")
    print(f"{'policy':<14} {'hit rate':>9} {'affinity':>9} {'seconds':>8}  requests per replica")
    for policy in args.policies.split(","):
        server = PagedServe([args.model, "--data-parallel-size", str(args.data_parallel_size), "--router-policy",
                             policy, "--num-gpu-blocks-override", str(args.num_blocks), "--disable-log-stats", *extra])
        try:
            run = run_workload(server.url, args.model, prompts, args.max_tokens, args.concurrency)
        finally:
            server.stop()
        shares = ", ".join(f"{e}: {v:.0f}" for e, v in sorted(run.requests.items()))
        print(f"{policy:<14} {run.hit_rate:>9.3f} {run.affinity_hits:>9.0f} {run.seconds:>8.2f}  {shares}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()

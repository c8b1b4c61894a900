"""What structured outputs cost, per grammar backend, as ratios measured in one run:

    python -m pagedserve.benchmarks.bench_structured [--backends guidance xgrammar] [engine args]

1. throughput: the chat-burst workload (32 chats at once, greedy) with a JSON schema
   on every request (one schema for the burst, new to the engine: its compile counts),
   against the same 32 chats unconstrained generating exactly as many tokens each
   (max_tokens = the constrained output's length, EOS ignored), so the ratio is the
   cost of the constraint alone;
2. time to first token of one request whose (nested) schema the engine has not seen,
   against one without a schema, alternated, medians;
3. inter-token latency of 16 running streams while a slow-to-compile schema (16
   bounded strings) compiles, against their median before it arrived.

Model load and the first structured request of a process (which indexes the
vocabulary for the backend, ~0.2-0.4 s) are outside every timed region.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import time
from typing import Any

from pagedserve.benchmarks import workloads as wl
from pagedserve.cpu_info import describe_cpu
from pagedserve.engine.arg_utils import EngineArgs

ANSWER = {"type": "object", "required": ["answer", "keywords", "confidence"], "properties": {
    "answer": {"type": "string"},
    "keywords": {"type": "array", "maxItems": 5, "items": {"type": "string", "maxLength": 24}},
    "confidence": {"type": "integer", "minimum": 0, "maximum": 100}}}
PERSON = {"type": "object", "required": ["name", "age", "role", "skills", "address"], "properties": {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer", "minimum": 18, "maximum": 99},
    "role": {"enum": ["engineer", "doctor", "teacher", "artist"]},
    "skills": {"type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "string", "maxLength": 16}},
    "address": {"type": "object", "required": ["city", "zip"], "properties": {
        "city": {"type": "string", "maxLength": 20}, "zip": {"type": "integer", "minimum": 10000, "maximum": 99999}}}}}
SLOW = {"type": "object", "required": [f"field_{i}" for i in range(16)],
        "properties": {f"field_{i}": {"type": "string", "maxLength": 40 + i} for i in range(16)}}
_fresh = itertools.count()


def fresh(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema under a title never used before: a new compile-cache key, same language."""
    return {**schema, "title": f"bench-{next(_fresh)}"}


def throughput(llm: Any, repeats: int) -> dict[str, float]:
    from pagedserve import SamplingParams
    from pagedserve.sampling_params import StructuredOutputsParams

    prompts = [llm.llm_engine.encode_chat(conv) for conv in wl.chat_burst().conversations]
    ratios, free_rates, json_rates = [], [], []
    for _ in range(repeats):
        constrained = SamplingParams(temperature=0, max_tokens=128,
                                     structured_outputs=StructuredOutputsParams(json=fresh(ANSWER)))
        t0 = time.perf_counter()
        outs = llm.generate(prompts, constrained, use_tqdm=False)
        json_s = time.perf_counter() - t0
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        free = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
        llm.llm_engine.reset_prefix_cache()
        t0 = time.perf_counter()
        llm.generate(prompts, free, use_tqdm=False)
        free_s = time.perf_counter() - t0
        llm.llm_engine.reset_prefix_cache()
        json_rates.append(sum(lengths) / json_s)
        free_rates.append(sum(lengths) / free_s)
        ratios.append(free_s / json_s)
    return {"json_tok_s": statistics.median(json_rates), "free_tok_s": statistics.median(free_rates),
            "ratio": statistics.median(ratios), "tokens": sum(lengths)}


def ttft(llm: Any, repeats: int) -> dict[str, float]:
    from pagedserve import SamplingParams
    from pagedserve.sampling_params import StructuredOutputsParams

    conv = [{"role": "user", "content": "Describe a chef from Lyon as JSON."}]
    none_s, schema_s = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        llm.chat(conv, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        none_s.append(time.perf_counter() - t0)
        params = SamplingParams(temperature=0, max_tokens=1,
                                structured_outputs=StructuredOutputsParams(json=fresh(PERSON)))
        t0 = time.perf_counter()
        llm.chat(conv, params, use_tqdm=False)
        schema_s.append(time.perf_counter() - t0)
    a, b = statistics.median(none_s), statistics.median(schema_s)
    return {"none_ms": 1e3 * a, "schema_ms": 1e3 * b, "ratio": b / a}


async def _itl_under_compile(llm: Any, streams: int, baseline_s: float) -> dict[str, Any]:
    from pagedserve import SamplingParams
    from pagedserve.engine.async_llm import AsyncLLM
    from pagedserve.sampling_params import StructuredOutputsParams

    engine = AsyncLLM(llm.llm_engine, log_stats=False)
    prompts = [llm.llm_engine.encode_chat(conv) for conv in wl.chat_burst().conversations[:streams]]
    arrivals: list[list[float]] = [[] for _ in range(streams)]
    stop = asyncio.Event()

    async def stream(i: int) -> None:
        params = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)
        agen = engine.generate(prompts[i], params, f"stream-{i}")
        try:
            async for _ in agen:
                arrivals[i].append(time.perf_counter())
                if stop.is_set():
                    break
        finally:
            await agen.aclose()

    tasks = [asyncio.create_task(stream(i)) for i in range(streams)]
    while min(len(a) for a in arrivals) < 5:
        await asyncio.sleep(0.05)
    t_base = time.perf_counter()
    await asyncio.sleep(baseline_s)
    t_submit = time.perf_counter()
    slow = SamplingParams(temperature=0, max_tokens=1, structured_outputs=StructuredOutputsParams(json=fresh(SLOW)))
    async for _ in engine.generate(prompts[0], slow, "slow"):
        pass
    t_done = time.perf_counter()
    if t_done - t_submit < 1.0:  # compiled at once: watch the streams for a second anyway
        await asyncio.sleep(1.0 - (t_done - t_submit))
    t_end = time.perf_counter()
    stop.set()
    await asyncio.gather(*tasks)
    engine.shutdown()

    def gaps(lo: float, hi: float) -> list[float]:
        return [b - a for arr in arrivals for a, b in zip(arr, arr[1:], strict=False) if lo <= a and b <= hi]

    before, during = gaps(t_base, t_submit), gaps(t_submit, t_end)
    return {"slow_first_token_s": t_done - t_submit, "itl_before_ms": 1e3 * statistics.median(before),
            "itl_during_ms": 1e3 * statistics.median(during), "n_during": len(during),
            "ratio": statistics.median(during) / statistics.median(before)}


def run_backend(engine_args: EngineArgs, backend: str, repeats: int, streams: int) -> dict[str, Any]:
    from pagedserve import LLM, LLMEngine, SamplingParams
    from pagedserve.sampling_params import StructuredOutputsParams

    llm = LLM.from_engine(LLMEngine.from_engine_args(engine_args.replace(structured_outputs_backend=backend)))
    # Warm-up: the model's first steps, and the backend's one-off vocabulary index.
    conv = [{"role": "user", "content": "Say hello."}]
    llm.chat(conv, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    llm.chat(conv, SamplingParams(temperature=0, max_tokens=8,
                                  structured_outputs=StructuredOutputsParams(json={"type": "object"})), use_tqdm=False)
    result = {"throughput": throughput(llm, repeats), "ttft": ttft(llm, 2 * repeats + 1),
              "itl": asyncio.run(_itl_under_compile(llm, streams, baseline_s=4.0))}
    llm.shutdown()
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pagedserve.benchmarks.bench_structured", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", nargs="+", default=["guidance", "xgrammar"], choices=["guidance", "xgrammar"])
    parser.add_argument("--repeats", type=int, default=2, help="throughput runs per backend (median)")
    parser.add_argument("--streams", type=int, default=16)
    EngineArgs.add_cli_args(parser, skip=("structured_outputs_backend",))
    args = parser.parse_args(argv)
    engine_args = EngineArgs.from_cli_args(args)
    print(f"CPU: {describe_cpu()}; model {engine_args.model}")
    for backend in args.backends:
        r = run_backend(engine_args, backend, args.repeats, args.streams)
        t, f, i = r["throughput"], r["ttft"], r["itl"]
        print(f"[{backend}] chat-burst with a JSON schema: {t['json_tok_s']:.1f} tok/s vs {t['free_tok_s']:.1f} "
              f"unconstrained for the same {t['tokens']} tokens: {100 * t['ratio']:.0f}%")
        print(f"[{backend}] time to first token, fresh nested schema vs none: {f['schema_ms']:.0f} ms vs "
              f"{f['none_ms']:.0f} ms: {f['ratio']:.2f}x")
        print(f"[{backend}] {args.streams} streams' inter-token latency while a 16-bounded-string schema compiles "
              f"(its first token after {i['slow_first_token_s']:.2f} s): median {i['itl_during_ms']:.0f} ms "
              f"({i['n_during']} gaps) vs {i['itl_before_ms']:.0f} ms before: {i['ratio']:.2f}x")


if __name__ == "__main__":
    main()

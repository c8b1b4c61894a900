"""kv_cache_dtype: quality against float32 KV and decode speed where attention's bytes
matter, side by side in one process.

Quality: 8 chat prompts x 64 greedy tokens on each model (a base model without a chat
template, such as the Gemma 3 270M file, gets their text), float32 compute, for every
KV dtype against float32 KV: how many tokens agree before the first divergence, and the
largest logprob difference of an agreed token (vLLM's check_logprobs_close rule).

Speed: 32 requests in flight with 1,024-token contexts decoding together, the model in
its default compute dtype and in float32 (the default on CPUs without native bf16), tok/s
per KV dtype (decoding timed after every prompt is prefilled).

    python -m pagedserve.benchmarks.bench_kv_dtype
    python -m pagedserve.benchmarks.bench_kv_dtype --models smollm2-135m-instruct gemma3-270m --skip-speed

A benchmark: it prints figures, asserts nothing.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from pagedserve import LLM, SamplingParams
from pagedserve.cpu_info import describe_cpu

CHATS = [
    "What is the capital of France?", "Write a haiku about autumn rain.", "Explain what a hash table is.",
    "List three uses of copper.", "Why is the sky blue?", "Translate 'good morning' into Spanish.",
    "What is 17 times 23?", "Give me a tip for learning to cook.",
]
NARROW = ("bfloat16", "float16", "int8", "fp8_e4m3", "fp8_e5m2")


def greedy_logprobs(model: str, kv: str) -> list[tuple[list[int], list[dict[int, float]]]]:
    llm = LLM(model, dtype="float32", kv_cache_dtype=kv, max_model_len=512, max_num_seqs=8)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, logprobs=5)
    try:
        if llm.llm_engine is not None and llm.llm_engine.chat_template is None:  # a base model: the text alone
            outs = llm.generate(CHATS, params, use_tqdm=False)
        else:
            outs = llm.chat([[{"role": "user", "content": c}] for c in CHATS], params, use_tqdm=False)
    finally:
        llm.shutdown()
    return [(list(o.outputs[0].token_ids), [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
            for o in outs]


def compare(ref: list, ours: list) -> tuple[int, float, bool]:
    """(tokens agreed before each prompt's first divergence, summed; the largest logprob
    difference of an agreed token; whether every divergence was a near-tie, each side's
    token in the other's top-5)."""
    agreed, worst, ties = 0, 0.0, True
    for (rt, rlp), (ot, olp) in zip(ref, ours, strict=True):
        for step, (a, b) in enumerate(zip(rt, ot, strict=True)):
            if a != b:
                ties &= a in olp[step] and b in rlp[step]
                break
            agreed += 1
            worst = max(worst, abs(rlp[step][a] - olp[step][a]))
    return agreed, worst, ties


def decode_speed(model: str, dtype: str, kv: str, in_flight: int, context: int, tokens: int) -> float:
    llm = LLM(model, dtype=dtype, kv_cache_dtype=kv, max_model_len=context + tokens + 16, max_num_seqs=in_flight,
              enable_prefix_caching=False)
    rng = random.Random(0)
    vocab = llm.llm_engine.vocab_size
    prompts = [{"prompt_token_ids": [rng.randrange(100, vocab - 100) for _ in range(context)]}
               for _ in range(in_flight)]
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    engine = llm.llm_engine
    try:
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, params)
        while any(r.num_computed_tokens < context for r in engine.scheduler.requests.values()):
            engine.step()  # every prompt prefilled first: what is timed is decoding alone
        t0, produced = time.perf_counter(), 0
        while engine.has_unfinished_requests():
            produced += sum(len(o.outputs[0].token_ids) for o in engine.step() if o.finished)
        return produced / (time.perf_counter() - t0)
    finally:
        llm.shutdown()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["smollm2-135m-instruct"])
    p.add_argument("--in-flight", type=int, default=32)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--skip-quality", action="store_true")
    p.add_argument("--skip-speed", action="store_true")
    args = p.parse_args(argv)
    print(f"CPU: {describe_cpu()}; threads {torch.get_num_threads()}")
    if not args.skip_quality:
        print("quality against float32 KV (float32 compute; 8 chats x 64 greedy tokens):")
        print("| model | KV dtype | tokens agreed (of 512) | max logprob difference of agreed tokens | "
              "divergences near-ties |")
        print("| --- | --- | --- | --- | --- |")
        for model in args.models:
            ref = greedy_logprobs(model, "auto")
            for kv in NARROW:
                agreed, worst, ties = compare(ref, greedy_logprobs(model, kv))
                print(f"| {model} | {kv} | {agreed} | {worst:.4f} | {'yes' if ties else 'no'} |", flush=True)
    if not args.skip_speed:
        model = args.models[0]
        print(f"decode speed, {args.in_flight} in flight, {args.context}-token contexts, {args.tokens} tokens each:")
        for dtype, kvs in (("auto", ("auto", "int8", "fp8_e4m3")), ("float32", ("auto", "bfloat16", "int8", "fp8_e4m3"))):
            for kv in kvs:
                rate = decode_speed(model, dtype, kv, args.in_flight, args.context, args.tokens)
                print(f"  {model} compute {dtype:8} KV {kv:9} {rate:8.1f} tok/s", flush=True)


if __name__ == "__main__":
    main()

"""Float32 decoding with the engine's swapped small-batch linears against plain F.linear,
side by side in one process (layers/linear.py, SWAPPED_FLOAT32_ROWS): SmolLM2-135M
dequantized (`quantization="none"`), 4 requests decoding together, best of 3 runs each,
and whether both gave the same greedy tokens.

    python -m pagedserve.benchmarks.bench_float32
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python -m pagedserve.benchmarks.bench_float32

A benchmark: it prints figures, asserts nothing.
"""

from __future__ import annotations

import argparse
import time

import torch

from pagedserve import LLM, SamplingParams
from pagedserve.cpu_info import describe_cpu
from pagedserve.layers import linear


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--tokens", type=int, default=128)
    args = p.parse_args(argv)
    llm = LLM(args.model, dtype="float32", quantization="none", max_num_seqs=args.requests, max_model_len=1024,
              kv_cache_memory_bytes="256MiB")
    prompts = [{"prompt_token_ids": [1 + i, 2, 3, 4, 5, 6, 7, 8]} for i in range(args.requests)]
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)

    def run() -> tuple[float, list[list[int]]]:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        return sum(len(o.outputs[0].token_ids) for o in outs) / seconds, [o.outputs[0].token_ids for o in outs]

    print(f"CPU: {describe_cpu()}; threads {torch.get_num_threads()}; {args.requests} requests x {args.tokens} tokens")
    run()  # warm-up
    default_rows = linear.SWAPPED_FLOAT32_ROWS
    results = {}
    for name, rows in (("swapped (the default)", default_rows), ("F.linear", range(0))):
        linear.SWAPPED_FLOAT32_ROWS = rows
        results[name] = max(run() for _ in range(3))
        print(f"{name:24} {results[name][0]:7.1f} tok/s", flush=True)
    linear.SWAPPED_FLOAT32_ROWS = default_rows
    (fast, fast_tokens), (slow, slow_tokens) = results.values()
    print(f"ratio {fast / slow:.2f}x; same greedy tokens: {fast_tokens == slow_tokens}")


if __name__ == "__main__":
    main()

"""`pagedserve bench latency`: vLLM's latency benchmark. One batch of `--batch-size`
random prompts of `--input-len` tokens, each answered with exactly `--output-len` tokens
(EOS ignored), timed end to end `--num-iters` times after `--num-iters-warmup` untimed
runs; the average and percentiles of a batch's latency are printed (and written with
--output-json).  Model load is not timed.

    pagedserve bench latency --input-len 32 --output-len 128 --batch-size 8
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from pagedserve.benchmarks.harness import check_output_file
from pagedserve.benchmarks.serve import percentile
from pagedserve.cpu_info import describe_cpu
from pagedserve.engine.arg_utils import EngineArgs

PERCENTILES = (10, 25, 50, 75, 90, 99)


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--input-len", type=int, default=32, help="prompt tokens (default: 32)")
    parser.add_argument("--output-len", type=int, default=128, help="tokens generated per sequence (default: 128)")
    parser.add_argument("--batch-size", type=int, default=8, help="prompts in the batch (default: 8)")
    parser.add_argument("--n", type=int, default=1, help="sequences sampled per prompt (default: 1)")
    parser.add_argument("--num-iters-warmup", type=int, default=10, help="untimed runs first (default: 10)")
    parser.add_argument("--num-iters", type=int, default=30, help="timed runs (default: 30)")
    parser.add_argument("--output-json", default=None, help="also write the latencies to this JSON file")
    EngineArgs.add_cli_args(parser)
    return parser


def check_args(args: argparse.Namespace) -> None:
    for name, least in (("input_len", 1), ("output_len", 1), ("batch_size", 1), ("n", 1), ("num_iters_warmup", 0),
                        ("num_iters", 1)):
        if getattr(args, name) < least:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {least}, got {getattr(args, name)}")
    check_output_file(args.output_json, "--output-json")


def run(args: argparse.Namespace) -> dict:
    from pagedserve import LLM, LLMEngine, SamplingParams

    check_args(args)
    engine_args = EngineArgs.from_cli_args(args)
    if args.input_len + args.output_len > (engine_args.max_model_len or args.input_len + args.output_len):
        raise ValueError(f"--input-len + --output-len ({args.input_len + args.output_len}) is more than "
                         f"--max-model-len {engine_args.max_model_len}")
    llm = LLM.from_engine(LLMEngine.from_engine_args(engine_args))
    rng = random.Random(engine_args.seed)
    vocab = min(10000, llm.llm_engine.vocab_size - 1)
    prompts = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(args.input_len)]}
               for _ in range(args.batch_size)]
    params = SamplingParams(n=args.n, temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=args.output_len)

    def one_batch() -> float:
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        assert all(len(c.token_ids) == args.output_len for o in outputs for c in o.outputs)
        llm.llm_engine.reset_prefix_cache()  # (each run prefills its prompts again, as the first did)
        return elapsed

    for _ in range(args.num_iters_warmup):
        one_batch()
    latencies = sorted(one_batch() for _ in range(args.num_iters))
    result = {"cpu": describe_cpu(), "model": engine_args.model, "avg_latency": statistics.fmean(latencies),
              "latencies": latencies, "percentiles": {str(p): percentile(latencies, p) for p in PERCENTILES}}
    print(f"CPU: {result['cpu']}")
    print(f"Avg latency: {result['avg_latency']:.4f} seconds")
    for p in PERCENTILES:
        print(f"{p}% percentile latency: {result['percentiles'][str(p)]:.4f} seconds")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = add_cli_args(argparse.ArgumentParser(prog="pagedserve bench latency", description=__doc__,
                                                  formatter_class=argparse.RawDescriptionHelpFormatter,
                                                  allow_abbrev=False))
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    main()

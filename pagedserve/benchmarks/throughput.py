"""Offline throughput: nano-vllm's bench.py shape, plus the chat workloads of benchmarks/workloads.py.

    pagedserve bench throughput --load-format dummy --num-prompts 64
    pagedserve bench throughput --workload chat-burst --dtype bfloat16

"random": N token-id prompts with random prompt and output lengths, EOS ignored, so
the work is fixed by the seed.  The timed region is one `generate()` call after a
warm-up; model load is excluded.  Output tokens are the tokens actually returned
(for chat-burst-natural that is each answer up to and including its EOS).

`--one-at-a-time N`: the first N requests of the workload, each alone (one user
chatting: every step is a batch of one), timed together.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

from pagedserve.benchmarks.harness import check_output_file
from pagedserve.cpu_info import describe_cpu
from pagedserve.engine.arg_utils import EngineArgs

WORKLOADS = ("random", "chat-burst", "chat-burst-natural", "shared-prefix", "edit-code")
RANDOM_DEFAULTS = {"num_prompts": 256, "input_len": (100, 1024), "output_len": (100, 1024)}


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--workload", choices=WORKLOADS, default="random",
                        help="random (nano-vllm bench.py) or a preset of benchmarks/workloads.py")
    parser.add_argument("--num-prompts", type=int, default=None,
                        help=f"random workload: number of requests (default: {RANDOM_DEFAULTS['num_prompts']})")
    for name, what in (("input_len", "prompt"), ("output_len", "output")):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, nargs="+", default=None, metavar="LEN",
                            help=f"random workload: {what} length, or a MIN MAX range, inclusive (default: "
                                 f"{' '.join(map(str, RANDOM_DEFAULTS[name]))})")
    parser.add_argument("--random-range-ratio", type=float, default=None,
                        help="vLLM's: a single length LEN varies uniformly within LEN x (1 +- this), in [0, 1)")
    parser.add_argument("--n", type=int, default=1, help="sequences sampled per prompt (random workload; default: 1)")
    parser.add_argument("--dataset-name", choices=["random"], default=None, help="vLLM's name of --workload random")
    parser.add_argument("--backend", choices=["vllm"], default=None, help="vLLM's: this engine, in-process")
    parser.add_argument("--temperature", type=float, default=None,
                        help="override the workload's temperature (random: 0.6, chat presets: 0)")
    parser.add_argument("--one-at-a-time", type=int, default=None, metavar="N",
                        help="run the first N requests one after another instead of all at once")
    parser.add_argument("--output-json", default=None, help="also write the figures to this JSON file")
    EngineArgs.add_cli_args(parser)
    return parser


def check_args(args: argparse.Namespace) -> None:
    """The benchmark's own flags, before the model loads (ValueError naming the flag); the
    random workload's sizes filled in.  A preset's sizes are its own: setting them is an
    error (they were ignored)."""
    from pagedserve.sampling_params import SamplingParams

    check_output_file(args.output_json, "--output-json")
    given = [f"--{k.replace('_', '-')}" for k in (*RANDOM_DEFAULTS, "random_range_ratio")
             if getattr(args, k) is not None] + (["--n"] if args.n != 1 else [])
    if args.dataset_name is not None and args.workload != "random":
        raise ValueError(f"--dataset-name random contradicts --workload {args.workload}")
    if args.workload != "random":
        if given:
            raise ValueError(f"{', '.join(given)} size the random workload; --workload {args.workload} has its own")
    else:
        for k, default in RANDOM_DEFAULTS.items():
            setattr(args, k, default if getattr(args, k) is None else getattr(args, k))
        ratio = args.random_range_ratio or 0.0
        if not 0 <= ratio < 1:
            raise ValueError(f"--random-range-ratio must be within [0, 1), got {ratio}")
        for k in ("input_len", "output_len"):
            value = list(getattr(args, k))
            if len(value) > 2 or len(value) == 2 and ratio:
                raise ValueError(f"--{k.replace('_', '-')} takes LEN (varied by --random-range-ratio) or MIN MAX")
            if not 1 <= value[0] <= value[-1]:  # (before LEN x (1 - ratio) is floored at 1: 0 and -4 ran as 1)
                raise ValueError(f"--{k.replace('_', '-')} takes 1 <= MIN <= MAX, got {' '.join(map(str, value))}")
            if len(value) == 1:  # (vLLM's: LEN x (1 - ratio) .. LEN x (1 + ratio))
                value = [max(1, int(value[0] * (1 - ratio))), max(1, int(value[0] * (1 + ratio)))]
            setattr(args, k, tuple(value))
        if args.num_prompts < 1 or args.n < 1:
            raise ValueError("--num-prompts and --n must be >= 1")
    if args.one_at_a_time is not None and args.one_at_a_time < 1:
        raise ValueError(f"--one-at-a-time must be >= 1 (requests), got {args.one_at_a_time}")
    if args.temperature is not None:
        SamplingParams(temperature=args.temperature)  # (its range, named)


def _random_workload(args: argparse.Namespace, vocab_size: int):
    from pagedserve.benchmarks import workloads as wl

    lo_in, hi_in = args.input_len
    lo_out, hi_out = args.output_len
    seed = args.seed if args.seed is not None else 0
    # nano-vllm draws ids in [0, 10000]; stay inside small vocabularies too.
    return wl.random_tokens(args.num_prompts, (lo_in, hi_in), (lo_out, hi_out),
                            vocab=min(10000, vocab_size - 1), seed=seed)


def build_requests(llm, args: argparse.Namespace):
    from pagedserve.benchmarks import workloads as wl

    engine = llm.llm_engine
    if args.workload == "random":
        w = _random_workload(args, engine.vocab_size)
    else:
        w = {"chat-burst": wl.chat_burst, "chat-burst-natural": wl.chat_burst_natural,
             "shared-prefix": wl.shared_prefix, "edit-code": wl.edit_code}[args.workload]()
    return (w, *workload_requests(engine, w, args.temperature))


def workload_requests(engine, w, temperature: float | None = None) -> tuple[list[dict], list]:
    """A workload's prompts (chat template applied) and sampling params for `engine`;
    `temperature` overrides the workload's."""
    from pagedserve import SamplingParams

    temperature = w.temperature if temperature is None else temperature
    if w.prompt_token_ids is not None:
        prompts = [{"prompt_token_ids": p} for p in w.prompt_token_ids]
    else:
        if engine.tokenizer is None:
            raise ValueError(f"workload {w.name} needs a tokenizer with a chat template; this model has none")
        prompts = [engine.encode_chat(conv) for conv in w.conversations]
    params = [SamplingParams(temperature=temperature, max_tokens=m, ignore_eos=w.ignore_eos)
              for m in w.max_tokens]
    return prompts, params


def generate_timed(llm, prompts: list, params: list, one_at_a_time: int | None = None) -> tuple[list, float]:
    """(outputs, seconds) of one generate() over all requests, or with `one_at_a_time` N
    the first N requests each alone (one user chatting), timed together."""
    t0 = time.perf_counter()
    if one_at_a_time is not None:
        outputs = [out for p, sp in zip(prompts[:one_at_a_time], params[:one_at_a_time], strict=True)
                   for out in llm.generate([p], sp, use_tqdm=False)]
    else:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    return outputs, time.perf_counter() - t0


def run(args: argparse.Namespace) -> dict:
    import torch

    from pagedserve import LLM, LLMEngine, SamplingParams

    check_args(args)
    engine_args = EngineArgs.from_cli_args(args)
    t0 = time.perf_counter()
    llm = LLM.from_engine(LLMEngine.from_engine_args(engine_args))
    load_s = time.perf_counter() - t0
    w, prompts, params = build_requests(llm, args)
    if args.n != 1:
        params = [dataclasses.replace(p, n=args.n) for p in params]

    # Warm-up: a few short requests (lazy compilation, allocator, caches).
    warm = [{"prompt_token_ids": p["prompt_token_ids"][:16]} for p in prompts[:4]]
    llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    llm.llm_engine.reset_prefix_cache()

    outputs, elapsed = generate_timed(llm, prompts, params, args.one_at_a_time)
    n_in = sum(len(o.prompt_token_ids) for o in outputs)
    n_out = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cfg = llm.llm_engine.config
    result = {
        "workload": w.name + (f" one at a time ({len(outputs)})" if args.one_at_a_time is not None else ""),
        "model": engine_args.model, "cpu": describe_cpu(), "dtype": str(cfg.model_config.dtype),
        "num_requests": len(outputs), "prompt_tokens": n_in, "output_tokens": n_out,
        "elapsed_s": round(elapsed, 3), "load_s": round(load_s, 2),
        "requests_per_s": len(outputs) / elapsed, "output_tok_per_s": n_out / elapsed,
        "total_tok_per_s": (n_in + n_out) / elapsed, "torch_threads": torch.get_num_threads(),
    }
    print(f"CPU: {result['cpu']}; dtype {result['dtype']}")
    print(f"workload {result['workload']}: {len(outputs)} requests, {n_in} prompt tokens, {n_out} output tokens "
          f"in {elapsed:.2f} s (model load {load_s:.1f} s, {torch.get_num_threads()} threads)")
    print(f"Throughput: {result['requests_per_s']:.2f} requests/s, {result['output_tok_per_s']:.1f} output "
          f"tok/s, {result['total_tok_per_s']:.1f} total tok/s")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = add_cli_args(argparse.ArgumentParser(
        prog="pagedserve bench throughput", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False))
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main()

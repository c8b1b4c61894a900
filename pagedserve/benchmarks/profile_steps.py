"""Where a steady decode step's time goes: wall time, host (Python) time by function,
and device time by kernel, for one engine configuration.

    python -m pagedserve.benchmarks.profile_steps                      # Qwen3-0.6B dummy, bf16, CUDA
    python -m pagedserve.benchmarks.profile_steps --batch 64 --context 2000 --enforce-eager

`--batch` requests of `--context` random prompt tokens are prefilled, then `--steps`
decode steps are timed three ways: plain (wall per step), under cProfile (the host's
functions by own time) and under torch.profiler (kernels by device time, and the
device's busy time per step).  A step whose wall time is well above its device time
is bound by the host; the cProfile table says by what.  Any engine flag can be added.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import time

from pagedserve.engine.arg_utils import EngineArgs


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=700)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--top", type=int, default=25)
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(model="qwen3-0.6b", load_format="dummy", dtype="bfloat16", max_model_len=4096,
                        device="cuda")
    return parser


def main(argv: list[str] | None = None) -> dict:
    import torch

    from pagedserve import LLMEngine, SamplingParams
    from pagedserve.platforms import is_cuda
    from pagedserve.sampling_params import RequestOutputKind

    args = add_cli_args(argparse.ArgumentParser(
        prog="python -m pagedserve.benchmarks.profile_steps", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)).parse_args(argv)
    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
    cuda = is_cuda(engine.model_executor.device)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.max_model_len - args.context)
    vocab = min(10000, engine.vocab_size)
    for i in range(args.batch):
        # FINAL_ONLY, as LLM.generate (and so bench_gpu) adds them: no per-step output objects.
        engine.add_request(f"p{i}", {"prompt_token_ids": [rng.randrange(1, vocab) for _ in range(args.context)]},
                           params, output_kind=RequestOutputKind.FINAL_ONLY)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()):
        engine.step()
    for _ in range(5):
        engine.step()
    sync()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    sync()
    wall_ms = (time.perf_counter() - t0) / args.steps * 1e3

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.steps):
        engine.step()
    sync()
    prof.disable()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    host_ms = stats.total_tt / args.steps * 1e3
    stats.sort_stats("tottime").print_stats(args.top)
    stats.sort_stats("cumulative").print_stats(args.top)

    result = {"batch": args.batch, "context": args.context, "wall_ms_per_step": round(wall_ms, 3),
              "cprofile_ms_per_step": round(host_ms, 3)}
    if cuda:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tp:
            for _ in range(args.steps):
                engine.step()
            sync()
        events = tp.key_averages()
        device_us = sum(e.self_device_time_total for e in events)
        result["device_ms_per_step"] = round(device_us / args.steps / 1e3, 3)
        print(events.table(sort_by="self_cuda_time_total", row_limit=args.top, max_name_column_width=60))
    print(text.getvalue())
    print(f"batch {args.batch} x context {args.context}: wall {wall_ms:.2f} ms/step, "
          f"under cProfile {host_ms:.2f} ms/step of host functions"
          + (f", device busy {result['device_ms_per_step']:.2f} ms/step" if cuda else ""))
    for _ in range(3):  # drain
        engine.abort_request([f"p{i}" for i in range(args.batch)])
        engine.step()
    return result


if __name__ == "__main__":
    main()

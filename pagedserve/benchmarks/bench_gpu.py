"""W1 and W2 (below) on a GPU, with CUDA graphs and overlap scheduling each
on and off, side by side in one run (so the ratios compare like with like).

    python -m pagedserve.benchmarks.bench_gpu                       # all four configs
    python -m pagedserve.benchmarks.bench_gpu --configs graphs+overlap --workloads w1

W1 = nano-vllm's bench.py: Qwen3-0.6B config, dummy weights, bf16, max_model_len
4096; random.seed(0); 256 prompts of 100..1024 random ids, max_tokens 100..1024,
temperature 0.6, EOS ignored (133,966 output tokens).  W2: the same prompts, greedy,
max_tokens 256 each (65,536 output tokens).  Throughput = output tokens / wall time
of one generate() call after a warm-up; each config gets a fresh engine.  Any
engine flag can be added (--max-num-batched-tokens 16384, --block-size 32, ...);
--device cpu with a tiny model and small --num-prompts is a dry run of the script.
"""

from __future__ import annotations

import argparse
import gc
import json
import time

from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.platforms import is_cuda

CONFIGS = {  # name -> (enforce_eager, async_scheduling)
    "eager": (True, False),
    "eager+overlap": (True, True),
    "graphs": (False, False),
    "graphs+overlap": (False, True),
}
# The H100 floors (docs/gpu_notes.md) and the peers' figures the GPU issue measures against.
REFERENCE = {
    "w1": "floor ~24,600 tok/s on H100; target >= 10,000; vLLM 8,588 on A800 (~14,100 scaled to H100)",
    "w2": "floor ~30,700 tok/s on H100; target >= 14,940 (20x HF continuous batching's 747)",
}


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--workloads", nargs="+", choices=["w1", "w2"], default=["w1", "w2"])
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--max-input-len", type=int, default=1024)
    parser.add_argument("--max-output-len", type=int, default=1024)
    parser.add_argument("--output-json", default=None)
    EngineArgs.add_cli_args(parser, skip=("enforce_eager", "async_scheduling"))
    parser.set_defaults(model="qwen3-0.6b", load_format="dummy", dtype="bfloat16", max_model_len=4096,
                        device="cuda")
    return parser


def build_workloads(args: argparse.Namespace, vocab_size: int) -> dict:
    from pagedserve import SamplingParams
    from pagedserve.benchmarks import workloads as wl

    w = wl.random_tokens(args.num_prompts, (min(100, args.max_input_len), args.max_input_len),
                         (min(100, args.max_output_len), args.max_output_len),
                         vocab=min(10000, vocab_size - 1), seed=0, temperature=0.6)
    prompts = [{"prompt_token_ids": p} for p in w.prompt_token_ids]
    out = {}
    if "w1" in args.workloads:
        out["w1"] = (prompts, [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m) for m in w.max_tokens])
    if "w2" in args.workloads:
        n = min(256, args.max_output_len)
        out["w2"] = (prompts, [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n)] * len(prompts))
    return out


def run_config(args: argparse.Namespace, name: str, greedy_out: dict[str, list[list[int]]] | None = None) -> dict:
    """One fresh engine in config `name`: a warm-up, then each workload timed.  The
    greedy workloads' token ids go into `greedy_out` (workload -> per prompt) for
    compare_greedy."""
    import torch

    from pagedserve import LLM, LLMEngine, SamplingParams
    from pagedserve.worker.model_runner import ModelRunner

    eager, overlap = CONFIGS[name]
    engine_args = EngineArgs.from_cli_args(args, enforce_eager=eager, async_scheduling=overlap)
    t0 = time.perf_counter()
    llm = LLM.from_engine(LLMEngine.from_engine_args(engine_args))
    load_s = time.perf_counter() - t0
    engine = llm.llm_engine
    runner = engine.model_executor
    assert isinstance(runner, ModelRunner), "bench_gpu runs one GPU (tensor_parallel_size 1)"
    graphs = runner.graph_runner
    result = {"config": name, "load_s": round(load_s, 1), "async_scheduling": engine.async_scheduling,
              "cuda_graphs": graphs is not None and graphs.use_graphs,
              "kv_blocks": engine.config.cache_config.num_blocks, "workloads": {}}
    sync = torch.cuda.synchronize if torch.cuda.is_available() and is_cuda(runner.device) else (lambda: None)
    try:
        llm.generate([{"prompt_token_ids": list(range(1, 33))}] * 4,
                     SamplingParams(temperature=0.6, max_tokens=32, ignore_eos=True), use_tqdm=False)
        for wname, (prompts, params) in build_workloads(args, engine.vocab_size).items():
            engine.reset_prefix_cache()
            replays0 = graphs.num_replays if result["cuda_graphs"] else 0
            sync()
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            sync()
            elapsed = time.perf_counter() - t0
            n_out = sum(len(c.token_ids) for o in outs for c in o.outputs)
            if greedy_out is not None and all(p.temperature == 0 for p in params):
                greedy_out[wname] = [list(o.outputs[0].token_ids) for o in outs]
            result["workloads"][wname] = {
                "output_tokens": n_out, "elapsed_s": round(elapsed, 3), "output_tok_per_s": round(n_out / elapsed, 1),
                "graph_replays": (graphs.num_replays - replays0) if result["cuda_graphs"] else 0,
                "preemptions": engine.get_stats().num_preemptions,
            }
            print(f"  {name:15s} {wname}: {n_out} tokens in {elapsed:.2f} s = {n_out / elapsed:,.0f} tok/s", flush=True)
    finally:
        llm.shutdown()
        del llm, engine, runner, graphs
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return result


def compare_greedy(tokens: dict[str, dict[str, list[list[int]]]]) -> dict[str, dict[str, dict]]:
    """Per greedy workload and config: how many sequences are token-for-token equal to
    the first config's, and the first position where any differs (None: all equal)."""
    report: dict[str, dict[str, dict]] = {}
    names = list(tokens)
    if not names:
        return report
    for w in tokens[names[0]]:
        ref = tokens[names[0]][w]
        report[w] = {}
        for name in names[1:]:
            got = tokens[name].get(w)
            if got is None:
                continue
            diverge = [next((k for k, (a, b) in enumerate(zip(x, y, strict=False)) if a != b), min(len(x), len(y)))
                       for x, y in zip(ref, got, strict=True) if x != y]
            report[w][name] = {"identical": len(ref) - len(diverge), "of": len(ref),
                               "first_divergence": min(diverge) if diverge else None}
    return report


def main(argv: list[str] | None = None) -> list[dict]:
    parser = add_cli_args(argparse.ArgumentParser(
        prog="python -m pagedserve.benchmarks.bench_gpu", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter))
    args = parser.parse_args(argv)
    tokens: dict[str, dict[str, list[list[int]]]] = {name: {} for name in args.configs}
    results = [run_config(args, name, tokens[name]) for name in args.configs]
    same = compare_greedy(tokens)
    for r in results:
        r["greedy_vs_first"] = {w: rep[r["config"]] for w, rep in same.items() if r["config"] in rep}
    print(f"\n{'config':16s}" + "".join(f"{w + ' tok/s':>14s}" for w in args.workloads)
          + "   graphs  overlap  kv blocks")
    for r in results:
        cells = "".join(f"{r['workloads'][w]['output_tok_per_s']:>14,.0f}" for w in args.workloads)
        print(f"{r['config']:16s}{cells}   {str(r['cuda_graphs']):6s}  {str(r['async_scheduling']):7s}  "
              f"{r['kv_blocks']}")
    for w in args.workloads:
        print(f"{w}: {REFERENCE[w]}")
    for w, rep in same.items():
        for name, c in rep.items():
            print(f"greedy {w}: {name} vs {args.configs[0]}: {c['identical']}/{c['of']} sequences identical"
                  + ("" if c["first_divergence"] is None else f", first divergence at token {c['first_divergence']}"))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()

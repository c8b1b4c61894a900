"""Speculative decoding (n-gram, or a draft model with --speculative-config) against none,
side by side in one process.

    python -m pagedserve.benchmarks.bench_spec [engine args, e.g. --dtype float32]

Two engines of the same model, one with `--speculative-config` (default: n-gram, 8
drafts) and one without, take turns on three workloads (benchmarks/workloads.py):

- edit-code, one request at a time: code given back with a small change, where drafts
  copied from the prompt should be accepted;
- single-stream chat: the first 8 chat-burst requests one at a time (128 tokens each):
  little to copy, so speculation must cost nothing;
- chat-burst: 32 requests at once: the batch is past `disable_by_batch_size`, so
  speculation stays off and must cost nothing;
- sampled-chat: the single-stream chat at temperature 0.8, where text copies little and
  most drafts are wrong: what speculation costs when it does not pay;
- predicted-edit: edit-code one at a time with the original snippet as each request's
  predicted output (OpenAI's `prediction`), against the same requests without it, on
  each engine: the one without speculation (where the prediction is the only draft
  source, as on a server started with `--speculative-config off`) and the n-gram one
  (the defaults).  It prints tok/s with and without, the prediction's accepted and
  rejected tokens, and how many outputs were the same.

Both engines get the same KV budget (SAME_KV_BUDGET unless --kv-cache-memory-bytes is given).

Per workload it prints output tok/s for both, the ratio, the draft acceptance, and how
many outputs were token for token the same (sampled requests are seeded, and
speculation keeps a seeded request's draws).  Model load and a warm-up are
excluded; every figure comes from this one run on this machine (the CPU is printed).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from pagedserve.benchmarks.throughput import generate_timed, workload_requests
from pagedserve.config import SPECULATION_OFF
from pagedserve.cpu_info import describe_cpu
from pagedserve.engine.arg_utils import EngineArgs

DEFAULT_SPEC = {"method": "ngram", "num_speculative_tokens": 8}
SAME_KV_BUDGET = "1GiB"  # each engine's KV cache unless --kv-cache-memory-bytes says otherwise


WORKLOADS = ("edit-code", "single-chat", "chat-burst", "sampled-chat", "predicted-edit")
EDIT_REQUESTS = 8  # edit-code and predicted-edit: how many requests, one at a time
SAMPLED_TEMPERATURE = 0.8  # sampled-chat: text that copies little (drafts are mostly wrong)


def _workloads(names: list[str]) -> list[tuple[str, Any, int | None]]:
    """(label, workload, how many to run one at a time; None: all at once)."""
    from pagedserve.benchmarks import workloads as wl

    sampled = wl.chat_burst()
    sampled.temperature = SAMPLED_TEMPERATURE
    every = {"edit-code": ("edit-code, one at a time", wl.edit_code(), EDIT_REQUESTS),
             "single-chat": ("single-stream chat (chat-burst, one at a time)", wl.chat_burst(), 8),
             "chat-burst": ("chat-burst, 32 at once", wl.chat_burst(), None),
             "sampled-chat": (f"single-stream chat sampled at temperature {SAMPLED_TEMPERATURE}", sampled, 8)}
    return [every[n] for n in names if n in every]


def _run(llm: Any, w: Any, one_at_a_time: int | None,
         predict: bool = False) -> tuple[float, list[list[int]], tuple[int, int], tuple[int, int]]:
    """(output tok/s, each output's tokens, (drafted, accepted) by the engine's metrics,
    (accepted, rejected) prediction tokens); `predict`: with the workload's predictions."""
    engine = llm.llm_engine
    prompts, params = workload_requests(engine, w)
    # Seeded, so that sampled outputs can be compared too: speculation keeps each seeded draw.
    params = [dataclasses.replace(p, seed=i) if p.temperature > 0 else p for i, p in enumerate(params)]
    if predict:
        params = [dataclasses.replace(p, prediction=text) for p, text in zip(params, w.predictions, strict=True)]
    before = engine.get_stats()
    outs, elapsed = generate_timed(llm, prompts, params, one_at_a_time)
    after = engine.get_stats()
    spec = (after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens,
            after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    predicted = (sum(o.outputs[0].accepted_prediction_tokens or 0 for o in outs),
                 sum(o.outputs[0].rejected_prediction_tokens or 0 for o in outs))
    return sum(map(len, tokens)) / elapsed, tokens, spec, predicted


def _warm_up(llm: Any, names: list[str]) -> None:
    """Each selected workload's first request, untimed (predicted-edit's with and without
    its prediction): a round that is an engine's first at a workload's lengths ran slow
    (predicted-edit's first round without the prediction read 111.6 tok/s against 173.0 in
    later rounds; Zen 5, AVX-512 with native bf16), and with --repeat 1 that round was the figure."""
    from pagedserve.benchmarks import workloads as wl

    chosen = [w for _, w, _ in _workloads(names)] + ([wl.predicted_edit()] if "predicted-edit" in names else [])
    for w in chosen:
        prompts, params = workload_requests(llm.llm_engine, w)
        variants = [params[0]]
        if w.predictions:
            variants.append(dataclasses.replace(params[0], prediction=w.predictions[0]))
        for p in variants:
            llm.generate([prompts[0]], p, use_tqdm=False)


def _prediction_rows(llms: dict[str, Any], method: str, repeat: int) -> dict[str, Any]:
    """predicted-edit on each engine: the same requests with and without their prediction
    (best of `repeat` rounds, the order alternating)."""
    from pagedserve.benchmarks import workloads as wl

    w = wl.predicted_edit()
    rows = {}
    for name, llm in llms.items():
        rates: dict[bool, list[float]] = {False: [], True: []}
        outputs: dict[bool, list[list[int]]] = {}
        for round_ in range(repeat):
            for predict in ((False, True) if round_ % 2 == 0 else (True, False)):
                llm.llm_engine.reset_prefix_cache()
                rate, outputs[predict], _, counts = _run(llm, w, EDIT_REQUESTS, predict)
                rates[predict].append(rate)
                if predict:
                    accepted, rejected = counts
        without, with_ = max(rates[False]), max(rates[True])
        same = sum(a == b for a, b in zip(outputs[False], outputs[True], strict=True))
        label = "speculation off" if name == "off" else f"{method} (the defaults)"
        rows[label] = {"without_tok_s": without, "with_tok_s": with_, "ratio": with_ / without,
                       "accepted_prediction_tokens": accepted, "rejected_prediction_tokens": rejected,
                       "identical_outputs": f"{same}/{len(outputs[False])}",
                       "output_tokens": sum(map(len, outputs[True]))}
        print(f"predicted-edit, {label}: without prediction {without:.1f} tok/s, with {with_:.1f} tok/s, ratio "
              f"{with_ / without:.2f}x; prediction tokens accepted {accepted}, rejected {rejected}; identical "
              f"outputs {same}/{len(outputs[False])}")
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    from pagedserve import LLM, LLMEngine, SamplingParams

    spec = json.loads(args.speculative_config) if args.speculative_config else DEFAULT_SPEC
    base = EngineArgs.from_cli_args(args).replace(speculative_config="off")
    if base.kv_cache_memory_bytes is None:
        # The same KV budget for both: sized from free memory, the second engine got less
        # than the first, and 32 requests at once preempted on it (0.88x with no draft).
        base = base.replace(kv_cache_memory_bytes=SAME_KV_BUDGET)
    llms = {"off": LLM.from_engine(LLMEngine.from_engine_args(base)),
            "spec": LLM.from_engine(LLMEngine.from_engine_args(base.replace(speculative_config=spec)))}
    method = llms["spec"].llm_engine.config.speculative_config.method
    for llm in llms.values():  # warm-up: compilation, kernels, allocator
        llm.generate(["Hello there, how are you?"] * 2, SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
        _warm_up(llm, args.workloads)
    print(f"CPU: {describe_cpu()}; model {base.model}; dtype {llms['off'].llm_engine.config.model_config.dtype}; "
          f"speculative_config {json.dumps(spec)}")
    results: dict[str, Any] = {"cpu": describe_cpu(), "model": base.model, "speculative_config": spec, "workloads": {}}
    for label, w, one in _workloads(args.workloads):
        rates, outputs, spec_counts = {}, {}, {}
        for round_ in range(args.repeat):
            for name, llm in (llms.items() if round_ % 2 == 0 else reversed(llms.items())):
                llm.llm_engine.reset_prefix_cache()
                rate, tokens, counts, _ = _run(llm, w, one)
                rates.setdefault(name, []).append(rate)
                outputs[name], spec_counts[name] = tokens, counts
        best = {name: max(r) for name, r in rates.items()}
        drafted, accepted = spec_counts["spec"]
        same = sum(a == b for a, b in zip(outputs["off"], outputs["spec"], strict=True))
        row = {"off_tok_s": best["off"], "spec_tok_s": best["spec"], "ratio": best["spec"] / best["off"],
               "drafted": drafted, "accepted": accepted, "identical_outputs": f"{same}/{len(outputs['off'])}",
               "output_tokens": sum(map(len, outputs["spec"]))}
        results["workloads"][label] = row
        rate = f"{100 * accepted / drafted:.0f}%" if drafted else "n/a"
        print(f"{label}: off {best['off']:.1f} tok/s, {method} {best['spec']:.1f} tok/s, ratio {row['ratio']:.2f}x; "
              f"drafts {drafted}, accepted {accepted} ({rate}); identical outputs {row['identical_outputs']}")
    if "predicted-edit" in args.workloads:
        results["workloads"]["predicted-edit"] = _prediction_rows(llms, method, args.repeat)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=2)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pagedserve.benchmarks.bench_spec", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=2, help="rounds per workload (best of; order alternates)")
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--output-json", default=None)
    EngineArgs.add_cli_args(parser)
    args = parser.parse_args(argv)
    try:
        check_args(args)
    except ValueError as e:
        parser.error(str(e))
    run(args)


def check_args(args: argparse.Namespace) -> None:
    """The engine's own checks of the flags, and the one value of theirs that means
    nothing here: `--speculative-config off` (this compares a method against none)."""
    if args.speculative_config == SPECULATION_OFF:
        raise ValueError(f"--speculative-config {SPECULATION_OFF}: bench_spec runs speculation off beside the method "
                         f"--speculative-config names (default {json.dumps(DEFAULT_SPEC)}); give a method's JSON")
    EngineArgs.from_cli_args(args)


if __name__ == "__main__":
    main()

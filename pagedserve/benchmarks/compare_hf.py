"""pagedserve vs HF transformers' static-batch `generate`, side by side in one run.

    python -m pagedserve.benchmarks.compare_hf [--workload chat-burst] [--dtype bfloat16] [--rounds 3]
                                               [--ablation] [--hf-source dense|gguf] [--skip-hf]

HF runs one left-padded static batch of all prompts, by default on the dense weights
pagedserve converted from the GGUF (`--hf-source dense`); with `--hf-source gguf` it
loads the GGUF itself, as a user gets it by default (dequantized at load; measured as
fast as the dense weights).  Both sides see the same
chat-templated prompts and are timed without model load (pagedserve's start-up, which
compiles the model on CPU, is load).  Each side lives in its own process, loaded once;
the parent alternates one timed run of each per round.  The figure reported is useful
output tokens per wall second, and the ratio between the two, per round and the median.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

import torch

from pagedserve.benchmarks.workloads import Workload, chat_burst, chat_burst_natural, shared_prefix

# pagedserve configurations of --ablation: name -> engine arguments.
ABLATION = {
    "pagedserve": {},
    "no-compile": {"torch_compile": False},
    "no-kernel": {"attention_backend": "torch_paged"},
    "neither": {"torch_compile": False, "attention_backend": "torch_paged"},
}
WORKLOADS = {"chat-burst": chat_burst, "chat-burst-natural": chat_burst_natural, "shared-prefix": shared_prefix}


def _useful_tokens(row: list[int], eos_id: int | None, ignore_eos: bool) -> int:
    """Tokens up to and including EOS: what a user keeps from a static batch row."""
    if ignore_eos or eos_id is None or eos_id not in row:
        return len(row)
    return row.index(eos_id) + 1


Runner = Callable[[], tuple[float, int]]  # one timed run -> (seconds, useful output tokens)


def setup_hf(path: str, prompts: list[str], w: Workload, dtype: torch.dtype) -> Runner:
    """Load HF once (and warm it up); the returned callable times one static-batch generate."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagedserve.model_loader.gguf_utils import load_gguf_tokenizer

    d, f = os.path.split(path) if path.endswith(".gguf") else (path, None)
    # (a GGUF's own tokenizer: AutoTokenizer took a tokenizer.json beside it in the folder)
    tok = load_gguf_tokenizer(path) if f else AutoTokenizer.from_pretrained(d)
    tok.padding_side = "left"
    if tok.pad_token is None:  # GGUF tokenizers may carry neither pad nor eos token names
        tok.pad_token = tok.eos_token or tok.convert_ids_to_tokens(0)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=dtype).eval()
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    n = max(w.max_tokens)
    extra = {"min_new_tokens": n} if w.ignore_eos else {}
    with torch.inference_mode():
        model.generate(**{k: v[:2] for k, v in enc.items()}, max_new_tokens=4, do_sample=False)  # warm-up

    def run() -> tuple[float, int]:
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = model.generate(**enc, max_new_tokens=n, do_sample=False, pad_token_id=tok.pad_token_id, **extra)
            dt = time.perf_counter() - t0
        gen = out[:, enc["input_ids"].shape[1] :].tolist()
        return dt, sum(_useful_tokens(r, tok.eos_token_id, w.ignore_eos) for r in gen)

    return run


def setup_pagedserve(model: str, prompts: list[str], w: Workload, dtype: str, **engine_args) -> Runner:
    """Load the engine once (start-up compiles where it applies; not timed) and warm it up."""
    from pagedserve import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, **engine_args)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=w.ignore_eos) for m in w.max_tokens]
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm-up

    def run() -> tuple[float, int]:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        return dt, sum(len(o.outputs[0].token_ids) for o in outs)

    return run


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="chat-burst")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--hf-source", choices=["dense", "gguf"], default="dense")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--rounds", type=int, default=3, help="timed runs of each side, alternating")
    p.add_argument("--ablation", action="store_true",
                   help="also run pagedserve without torch.compile, without the C++ decode kernel, and without both")
    args = p.parse_args(argv)

    from pagedserve.model_loader.sources import resolve_source
    from pagedserve.model_loader.tokenizer import load_chat_prompts

    w = WORKLOADS[args.workload]()
    prompts = load_chat_prompts(args.model, w.conversations)
    print(f"workload {w.name}: {len(prompts)} requests, max_tokens {max(w.max_tokens)}, dtype {args.dtype}, "
          f"threads {torch.get_num_threads()}")
    variants = {"pagedserve": {}}
    if args.ablation:  # the CPU speed-ups switched off one at a time, then both
        variants = {name: dict(kw, kv_cache_memory_bytes="1GiB") for name, kw in ABLATION.items()}
    sides = [_Side(name, setup_pagedserve, (args.model, prompts, w, args.dtype), kw) for name, kw in variants.items()]
    if not args.skip_hf:
        fmt = "gguf" if args.hf_source == "gguf" else "safetensors"
        sides.append(_Side(f"HF generate ({args.hf_source} weights)", setup_hf,
                           (resolve_source(args.model, fmt).path, prompts, w, getattr(torch, args.dtype))))
    ratios: dict[str, list[float]] = {name: [] for name in variants}
    try:
        for side in sides:
            side.wait_ready()
        # Rounds alternate the sides, so that load from elsewhere on a shared machine
        # hits them alike; each round's ratios are of runs seconds apart.
        for r in range(1, args.rounds + 1):
            rates = []
            parts = []
            for side in sides:
                dt, tokens = side.run()
                rates.append(tokens / dt)
                parts.append(f"{side.name} {tokens / dt:7.1f} tok/s ({tokens} tokens in {dt:.2f} s)")
            if not args.skip_hf:
                for name, rate in zip(variants, rates, strict=False):
                    ratios[name].append(rate / rates[-1])
                parts.append("ratio " + ", ".join(f"{ratios[n][-1]:.2f}x" for n in variants))
            print(f"round {r}: " + " | ".join(parts), flush=True)
    finally:
        for side in sides:
            side.close()
    for name, rs in ratios.items():
        if rs:
            print(f"ratio {name} / HF: median {statistics.median(rs):.2f}x "
                  f"(min {min(rs):.2f}x, max {max(rs):.2f}x over {len(rs)} rounds)")


def _serve_side(conn: Connection, setup: Callable[..., Runner], setup_args: tuple, setup_kwargs: dict) -> None:
    """Child process: load one side, then time one run per request from the parent."""
    run = setup(*setup_args, **setup_kwargs)
    conn.send("ready")
    while conn.recv() == "run":
        conn.send(run())


class _Side:
    """One side of the comparison in its own process: neither side's allocator state,
    threads or compiled code can slow the other, and the idle side only waits."""

    def __init__(self, name: str, setup: Callable[..., Runner], setup_args: tuple,
                 setup_kwargs: dict | None = None) -> None:
        self.name = name
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve_side, args=(child, setup, setup_args, setup_kwargs or {}),
                                 daemon=True)
        self._proc.start()

    def wait_ready(self) -> None:
        if self._conn.recv() != "ready":
            raise RuntimeError(f"{self.name}: set-up failed")

    def run(self) -> tuple[float, int]:
        self._conn.send("run")
        return self._conn.recv()

    def close(self) -> None:
        try:
            self._conn.send("stop")
        except (BrokenPipeError, OSError):
            pass
        self._proc.join(timeout=30)
        if self._proc.is_alive():
            self._proc.kill()


if __name__ == "__main__":
    main()

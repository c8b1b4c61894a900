"""pagedserve vs HF transformers' static-batch `generate`, side by side in one run.

    python -m pagedserve.benchmarks.compare_hf [--workload chat-burst] [--dtype bfloat16]

HF runs one left-padded static batch of all prompts, by default on the dense weights
pagedserve converted from the GGUF (`--hf-source dense`, the stronger baseline); with
`--hf-source gguf` it loads the GGUF itself as a user gets it by default (transformers 5
then keeps the weights packed and dequantizes inside float32 kernels: much slower).  Both sides see the same
chat-templated prompts and are timed without model load; the figure reported is
useful output tokens per wall second, and the ratio between the two.
"""

from __future__ import annotations

import argparse
import gc
import os
import time

import torch

from pagedserve.benchmarks.workloads import Workload, chat_burst, chat_burst_natural, shared_prefix

WORKLOADS = {"chat-burst": chat_burst, "chat-burst-natural": chat_burst_natural, "shared-prefix": shared_prefix}


def _useful_tokens(row: list[int], eos_id: int | None, ignore_eos: bool) -> int:
    """Tokens up to and including EOS: what a user keeps from a static batch row."""
    if ignore_eos or eos_id is None or eos_id not in row:
        return len(row)
    return row.index(eos_id) + 1


def run_hf(path: str, prompts: list[str], w: Workload, dtype: torch.dtype) -> tuple[float, int]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, f = os.path.split(path) if path.endswith(".gguf") else (path, None)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    tok.padding_side = "left"
    if tok.pad_token is None:  # GGUF tokenizers may carry neither pad nor eos token names
        tok.pad_token = tok.eos_token or tok.convert_ids_to_tokens(0)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=dtype).eval()
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    n = max(w.max_tokens)
    extra = {"min_new_tokens": n} if w.ignore_eos else {}
    with torch.inference_mode():
        model.generate(**{k: v[:2] for k, v in enc.items()}, max_new_tokens=4, do_sample=False)  # warm-up
        t0 = time.perf_counter()
        out = model.generate(**enc, max_new_tokens=n, do_sample=False, pad_token_id=tok.pad_token_id, **extra)
        dt = time.perf_counter() - t0
    gen = out[:, enc["input_ids"].shape[1] :].tolist()
    tokens = sum(_useful_tokens(r, tok.eos_token_id, w.ignore_eos) for r in gen)
    del model
    gc.collect()
    return dt, tokens


def run_pagedserve(model: str, prompts: list[str], w: Workload, dtype: str, **engine_args) -> tuple[float, int]:
    from pagedserve import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, **engine_args)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=w.ignore_eos) for m in w.max_tokens]
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    del llm
    gc.collect()
    return dt, tokens


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="chat-burst")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--hf-source", choices=["dense", "gguf"], default="dense")
    p.add_argument("--skip-hf", action="store_true")
    args = p.parse_args(argv)

    from pagedserve.model_loader.sources import resolve_source
    from pagedserve.model_loader.tokenizer import load_chat_prompts

    w = WORKLOADS[args.workload]()
    prompts = load_chat_prompts(args.model, w.conversations)
    print(f"workload {w.name}: {len(prompts)} requests, max_tokens {max(w.max_tokens)}, dtype {args.dtype}, "
          f"threads {torch.get_num_threads()}")
    ps_dt, ps_tok = run_pagedserve(args.model, prompts, w, args.dtype)
    print(f"pagedserve : {ps_tok} tokens in {ps_dt:.2f} s = {ps_tok / ps_dt:.1f} output tok/s")
    if args.skip_hf:
        return
    fmt = "gguf" if args.hf_source == "gguf" else "safetensors"
    hf_path = resolve_source(args.model, fmt).path
    hf_dt, hf_tok = run_hf(hf_path, prompts, w, getattr(torch, args.dtype))
    print(f"HF generate ({args.hf_source} weights): {hf_tok} tokens in {hf_dt:.2f} s = {hf_tok / hf_dt:.1f} output tok/s")
    print(f"ratio pagedserve / HF = {(ps_tok / ps_dt) / (hf_tok / hf_dt):.2f}x")


if __name__ == "__main__":
    main()

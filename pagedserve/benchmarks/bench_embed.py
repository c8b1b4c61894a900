"""Embedding throughput: 256 short texts through the pooling runner (`LLM(...,
runner="pooling").embed`), all at once and one at a time, and HF transformers on the
same converted weights in padded batches of 32 (float32, last-token pooling as ours),
side by side in one process, with the cosine of our vectors against HF's.

    python -m pagedserve.benchmarks.bench_embed
    python -m pagedserve.benchmarks.bench_embed --dtype float32

A benchmark: it prints figures, asserts nothing.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from pagedserve import LLM
from pagedserve.cpu_info import describe_cpu

_WORDS = ("the market river engine model paris data cloud green small quickly under returns city "
          "network protein song winter query search vector answer battery garden price").split()


def short_texts(n: int, seed: int = 0) -> list[str]:
    """n sentences of 6 to 30 words (8 to 40 tokens), each distinct."""
    rng = random.Random(seed)
    return [f"{i}: " + " ".join(rng.choice(_WORDS) for _ in range(rng.randint(6, 30))) + "." for i in range(n)]


def hf_embed(path: str, texts: list[str], batch: int = 32) -> torch.Tensor:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "right"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rows = []
    with torch.inference_mode():
        for i in range(0, len(texts), batch):
            enc = tok(texts[i: i + batch], return_tensors="pt", padding=True)
            states = model.model(**enc).last_hidden_state
            last = enc["attention_mask"].sum(1) - 1
            rows.append(states[torch.arange(len(last)), last])
    return torch.nn.functional.normalize(torch.cat(rows), dim=-1)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--texts", type=int, default=256)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--no-hf", action="store_true", help="skip HF transformers")
    args = p.parse_args(argv)
    texts = short_texts(args.texts)
    llm = LLM(args.model, runner="pooling", dtype=args.dtype, max_model_len=512, enable_prefix_caching=False)
    engine = llm.llm_engine
    assert engine is not None
    tokens = sum(len(engine.tokenizer.encode(t)) for t in texts)
    print(f"CPU: {describe_cpu()}; threads {torch.get_num_threads()}; {args.model} ({engine.model_config.dtype}, "
          f"{engine.model_config.quantization}); {len(texts)} texts, {tokens} tokens")
    llm.embed(texts[:8], use_tqdm=False)  # warm-up

    t0 = time.perf_counter()
    ours = torch.tensor([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)])
    batched = time.perf_counter() - t0
    print(f"pagedserve, one call of {len(texts)}:  {len(texts) / batched:8.1f} texts/s  {tokens / batched:9.0f} tok/s")
    t0 = time.perf_counter()
    for t in texts:
        llm.embed(t, use_tqdm=False)
    single = time.perf_counter() - t0
    print(f"pagedserve, one text at a time: {len(texts) / single:8.1f} texts/s  {tokens / single:9.0f} tok/s "
          f"(batching: {single / batched:.2f}x)")
    if args.no_hf:
        return
    from pagedserve.model_loader.sources import MODEL_NAMES, ensure_converted

    path = ensure_converted(MODEL_NAMES[args.model]) if args.model in MODEL_NAMES else args.model
    hf_embed(path, texts[:8])  # warm-up
    t0 = time.perf_counter()
    ref = hf_embed(path, texts)
    hf = time.perf_counter() - t0
    cos = torch.nn.functional.cosine_similarity(ours, ref, dim=-1)
    print(f"HF transformers, batches of 32: {len(texts) / hf:8.1f} texts/s  {tokens / hf:9.0f} tok/s "
          f"(pagedserve one call: {hf / batched:.2f}x)")
    print(f"cosine of ours against HF's: min {cos.min():.5f}, mean {cos.mean():.5f}")


if __name__ == "__main__":
    main()

"""Multi-LoRA throughput: 32 requests spread over 4 adapters against the same 32 on the
base model, side by side in one process, and the memory each resident adapter takes.

The same prompts (random token ids, every request generating the same number of
tokens): the base model on an engine without LoRA, then on an engine with LoRA enabled
the base model and the 32 requests cycling over 4 random rank-8 adapters on every
attention and MLP projection (PEFT's format, written to a temporary directory), all 4
resident at once, those two taking turns for --rounds rounds; the ratio is the median
of the rounds' (this shared machine's speed drifts between runs).

    python -m pagedserve.benchmarks.bench_lora
    python -m pagedserve.benchmarks.bench_lora --model smollm2-135m-instruct --rank 16 --output-len 128

A benchmark: it prints figures, asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time

import torch

from pagedserve import LLM, LoRARequest, SamplingParams
from pagedserve.cpu_info import describe_cpu

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(path: str, hf_config, rank: int, seed: int) -> str:
    """A random PEFT adapter (nonzero A and B) for a Llama-family model's projections."""
    from safetensors.torch import save_file

    c = hf_config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    shapes = {"q_proj": (c.hidden_size, c.num_attention_heads * head_dim),
              "k_proj": (c.hidden_size, kv_heads * head_dim), "v_proj": (c.hidden_size, kv_heads * head_dim),
              "o_proj": (c.num_attention_heads * head_dim, c.hidden_size),
              "gate_proj": (c.hidden_size, c.intermediate_size), "up_proj": (c.hidden_size, c.intermediate_size),
              "down_proj": (c.intermediate_size, c.hidden_size)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(c.num_hidden_layers):
        for name in TARGETS:
            part = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{name}"
            fan_in, fan_out = shapes[name]
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) / fan_in ** 0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.01
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS)}, f)
    return path


def timed(llm: LLM, prompts: list[list[int]], params: SamplingParams, loras=None) -> tuple[float, int]:
    llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], params, use_tqdm=False,
                 lora_request=loras[:4] if loras else None)  # warm-up (and the adapters' first loads)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras)
    return time.perf_counter() - t0, sum(len(o.outputs[0].token_ids) for o in outs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--num-adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(describe_cpu())
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40_000) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    common = {"max_model_len": args.input_len + args.output_len + 16, "max_num_seqs": args.num_prompts}
    rows = []
    llm = LLM(args.model, **common)
    secs, toks = timed(llm, prompts, params)
    rows.append(("base model, LoRA off", secs, toks))
    hf_config = llm.llm_engine.model_config.hf_config
    llm.shutdown()
    del llm
    with tempfile.TemporaryDirectory() as tmp:
        loras = [LoRARequest(f"adapter{i}", i + 1, write_adapter(os.path.join(tmp, str(i)), hf_config, args.rank, i))
                 for i in range(args.num_adapters)]
        llm = LLM(args.model, enable_lora=True, max_loras=args.num_adapters, max_lora_rank=args.rank, **common)
        t0 = time.perf_counter()
        for lora in loras:  # what LLMEngine.add_lora costs between steps: read, check, lay out
            llm.llm_engine.add_lora(lora)
        load_ms = (time.perf_counter() - t0) * 1000 / len(loras)
        spread = [loras[i % len(loras)] for i in range(len(prompts))]
        on, adapted = [], []
        for _ in range(args.rounds):
            on.append(timed(llm, prompts, params))
            adapted.append(timed(llm, prompts, params, spread))
        ratios = sorted((a[1] / a[0]) / (b[1] / b[0]) for a, b in zip(adapted, on, strict=True))
        rows.append(("base model, LoRA on", *min(on, key=lambda r: r[0])))
        rows.append((f"{args.num_adapters} adapters, rank {args.rank}", *min(adapted, key=lambda r: r[0])))
        manager = llm.llm_engine.model_executor.lora_manager
        per_slot = manager.slot_bytes() / args.num_adapters
        per_host = manager.host_bytes() / args.num_adapters
        dtype = llm.llm_engine.model_config.dtype
        llm.shutdown()
    base_rate = rows[0][2] / rows[0][1]
    print(f"{args.model} ({dtype}), {args.num_prompts} requests x {args.input_len} prompt + {args.output_len} "
          "generated tokens")
    for name, secs, toks in rows:
        rate = toks / secs
        print(f"  {name:<28} {rate:8.1f} tok/s, best round ({rate / base_rate:.2f}x LoRA off)")
    print(f"  memory per resident adapter (rank {args.rank}, every attention and MLP projection, {dtype}): "
          f"{per_slot / 2**20:.2f} MiB packed in the layers, plus {per_host / 2**20:.2f} MiB in the host cache "
          "behind the slots")
    print(f"  adapters / base on the same engine, median of {args.rounds} rounds taking turns: "
          f"{ratios[len(ratios) // 2]:.2f}x (rounds: {', '.join(f'{r:.2f}' for r in ratios)})")
    print(f"  loading one adapter (read, check against the model, lay out; between steps): {load_ms:.1f} ms")


if __name__ == "__main__":
    main()

"""PEFT adapters with random nonzero weights, and HF + PEFT's greedy answers as the reference."""

from __future__ import annotations

import torch

from tests.e2e.test_hf_parity import greedy_tops

ATTN_MLP = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base_model, out_dir: str, seed: int, r: int = 8, targets: list[str] | None = None,
                 alpha: float = 16, rslora: bool = False, scale: float = 1.0) -> str:
    """Save a LoRA adapter of `base_model` (an HF model, left unchanged) with random A and
    B (B nonzero, unlike a fresh adapter's) into `out_dir`."""
    import copy

    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets or ATTN_MLP, use_rslora=rslora,
                        lora_dropout=0.0)
    model = get_peft_model(copy.deepcopy(base_model), config)
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "lora_A" in name:
            p.data = torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5
        elif "lora_B" in name:
            p.data = torch.randn(p.shape, generator=gen) * scale / p.shape[1] ** 0.5
    model.save_pretrained(out_dir)
    return out_dir


def peft_greedy(base_model, adapter_dir: str | None, prompts: list[list[int]], max_tokens: int,
                top: int = 5) -> list[tuple[list[int], list[dict[int, float]]]]:
    """Per prompt: greedy tokens and each step's top-`top` logprobs of the base model with
    the adapter applied (None: the base alone)."""
    import copy

    from peft import PeftModel

    model = base_model if adapter_dir is None else PeftModel.from_pretrained(copy.deepcopy(base_model), adapter_dir)
    return greedy_tops(model.eval(), prompts, max_tokens, top)


def cached_peft_greedy(base_model, base_key: str, adapter: tuple[str, dict] | None, prompts: list[list[int]],
                       max_tokens: int) -> list[tuple[list[int], list[dict[int, float]]]]:
    """peft_greedy for a real model, kept in the persistent cache (as hf_greedy keeps HF's
    answers): keyed by the base (`base_key`: what its weights depend on), the adapter's
    make_adapter arguments (adapter = (directory, kwargs); it is rebuilt from them, so
    equal kwargs mean equal weights), the library versions, the CPU's vector capability
    and the prompts."""
    import hashlib
    import json
    import os

    import peft
    import transformers

    from pagedserve.model_loader.sources import cache_dir

    key = json.dumps([base_key, adapter[1] if adapter else None, transformers.__version__, peft.__version__,
                      torch.__version__, torch.backends.cpu.get_cpu_capability(), prompts, max_tokens])
    path = os.path.join(cache_dir(), "hf-reference", "peft-outputs", hashlib.sha256(key.encode()).hexdigest()[:24])
    if os.path.isfile(path):
        with open(path) as f:
            return [(toks, [{int(t): lp for t, lp in step} for step in tops]) for toks, tops in json.load(f)]
    results = peft_greedy(base_model, adapter[0] if adapter else None, prompts, max_tokens)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(f"{path}.tmp-{os.getpid()}", "w") as f:
        json.dump([(toks, [list(step.items()) for step in tops]) for toks, tops in results], f)
    os.replace(f"{path}.tmp-{os.getpid()}", path)
    return results

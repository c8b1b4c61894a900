"""Reading a LoRA adapter in PEFT's format: adapter_config.json + adapter_model.safetensors.

An adapter adds (x A^T) B^T * scaling to a linear layer's output, A [r, in] and B [out,
r]; scaling is lora_alpha / r (or / sqrt(r) with rsLoRA).  Only what the engine computes
exactly is accepted: every other PEFT option that changes the math (DoRA, a bias,
per-module ranks, trained embeddings or LM head, ...) is refused by name, never
ignored.  The weights are read with safetensors (no pickle: a `.bin` adapter is
refused), and nothing here knows the model: which modules exist and their shapes are
checked by the worker's LoRA manager (lora/manager.py).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import torch

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20  # a PEFT config is a few hundred bytes
_PREFIX = "base_model.model."
# Config keys whose non-default value changes what the adapter computes, with that default.
_REFUSED_OPTIONS: dict[str, tuple[object, ...]] = {
    "use_dora": (False, None),
    "bias": ("none", None),
    "fan_in_fan_out": (False, None),
    "modules_to_save": (None, []),
    "rank_pattern": ({}, None),
    "alpha_pattern": ({}, None),
    "trainable_token_indices": (None, {}, []),
    "lora_bias": (False, None),
}


class LoRAAdapterError(ValueError):
    """An adapter that cannot be served, with the reason."""


@dataclass
class PeftAdapter:
    """One adapter as its files have it: per module name (the base model's, e.g.
    "model.layers.0.self_attn.q_proj"), A [r, in] and B [out, r] as stored."""

    rank: int
    scaling: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]


def _read_config(path: str) -> dict:
    config_path = os.path.join(path, ADAPTER_CONFIG)
    if not os.path.isfile(config_path):
        raise LoRAAdapterError(f"no {ADAPTER_CONFIG} in {path!r}: a LoRA adapter is a PEFT directory")
    if os.path.getsize(config_path) > MAX_CONFIG_BYTES:
        raise LoRAAdapterError(f"{config_path!r} is over {MAX_CONFIG_BYTES} bytes: not a PEFT adapter config")
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise LoRAAdapterError(f"cannot read {config_path!r}: {e}") from None
    if not isinstance(config, dict):
        raise LoRAAdapterError(f"{config_path!r} must hold a JSON object")
    return config


def _rank_and_scaling(config: dict, max_rank: int) -> tuple[int, float]:
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoRAAdapterError(f"peft_type {peft_type!r} is not a LoRA adapter (only LORA is served)")
    for key, defaults in _REFUSED_OPTIONS.items():
        if key in config and config[key] not in defaults:
            raise LoRAAdapterError(f"adapter option {key}={config[key]!r} is not supported (it changes the math "
                                   "and pagedserve does not implement it)")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise LoRAAdapterError(f"adapter rank r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise LoRAAdapterError(f"adapter rank r={rank} is over the maximum {max_rank} (--max-lora-rank)")
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise LoRAAdapterError(f"lora_alpha must be a number, got {alpha!r}")
    rslora = config.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise LoRAAdapterError(f"use_rslora must be true or false, got {rslora!r}")
    return rank, float(alpha) / (math.sqrt(rank) if rslora else rank)


def read_peft_adapter(path: str, max_rank: int, max_features: int | None = None) -> PeftAdapter:
    """The adapter in directory `path`; LoRAAdapterError naming what is wrong with it.
    `max_features`: the widest input or output of any layer it may adapt, so that a
    tensor too large for the model is refused from the file's header, before it is read."""
    if not os.path.isdir(path):
        raise LoRAAdapterError(f"LoRA adapter path {path!r} is not a directory")
    rank, scaling = _rank_and_scaling(_read_config(path), max_rank)
    weights_path = os.path.join(path, ADAPTER_WEIGHTS)
    if not os.path.isfile(weights_path):
        pickled = os.path.isfile(os.path.join(path, "adapter_model.bin"))
        raise LoRAAdapterError(f"no {ADAPTER_WEIGHTS} in {path!r}" + (
            " (adapter_model.bin is a pickle, which pagedserve does not load: save the adapter with "
            "safe_serialization=True)" if pickled else ""))
    from safetensors import SafetensorError, safe_open

    halves: dict[str, dict[str, torch.Tensor]] = {}
    try:
        with safe_open(weights_path, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                module, half = _split_key(key)
                shape = tuple(f.get_slice(key).get_shape())
                features = shape[1] if half == "lora_A" else shape[0] if shape else 0
                if len(shape) != 2 or rank not in shape or (max_features is not None and features > max_features):
                    raise LoRAAdapterError(f"adapter tensor {key!r} has shape {shape}, not a rank-{rank} LoRA "
                                           "matrix of this model's size")
                halves.setdefault(module, {})[half] = f.get_tensor(key)
    except (SafetensorError, OSError) as e:
        raise LoRAAdapterError(f"cannot read {weights_path!r}: {e}") from None
    weights = {}
    for module, pair in halves.items():
        if set(pair) != {"lora_A", "lora_B"}:
            raise LoRAAdapterError(f"adapter module {module!r} has {', '.join(sorted(pair))} but not both "
                                   "lora_A and lora_B")
        a, b = pair["lora_A"], pair["lora_B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise LoRAAdapterError(f"adapter module {module!r}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} "
                                   f"do not have rank r={rank} ([r, in] and [out, r])")
        if not (a.is_floating_point() and b.is_floating_point()):
            raise LoRAAdapterError(f"adapter module {module!r}: weights must be floating point")
        weights[module] = (a, b)
    if not weights:
        raise LoRAAdapterError(f"{weights_path!r} holds no LoRA weights")
    return PeftAdapter(rank, scaling, weights)


def _split_key(key: str) -> tuple[str, str]:
    """'base_model.model.<module>.lora_A.weight' -> (<module>, 'lora_A')."""
    name = key[len(_PREFIX):] if key.startswith(_PREFIX) else key
    parts = name.split(".")
    if any(p in ("lora_embedding_A", "lora_embedding_B", "embed_tokens", "lm_head") for p in parts):
        raise LoRAAdapterError(f"adapter tensor {key!r} adapts the embedding or LM head, which pagedserve does not "
                               "implement (only attention and MLP projections)")
    if len(parts) >= 3 and parts[-1] == "weight" and parts[-2] in ("lora_A", "lora_B"):
        return ".".join(parts[:-2]), parts[-2]
    raise LoRAAdapterError(f"adapter tensor {key!r} is not a LoRA weight (<module>.lora_A.weight / "
                           "<module>.lora_B.weight)")

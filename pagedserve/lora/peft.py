"""Reading a LoRA adapter in PEFT's format: adapter_config.json + adapter_model.safetensors.

An adapter adds (x A^T) B^T * scaling to a linear layer's output, A [r, in] and B [out,
r]; scaling is lora_alpha / r (or / sqrt(r) with rsLoRA).  Only what the engine computes
exactly is accepted: every other PEFT option that changes the math (DoRA, a bias,
per-module ranks, trained embeddings or LM head, ...) is refused by name, never
ignored.  The weights are read with safetensors (no pickle: a `.bin` adapter is
refused), and only once the file's header has shown every tensor to be one of the
model's adaptable modules at its exact shape: a crafted header claiming [8, 2^30] is
refused before a byte is read, not mapped into 32 GB.  The weights must be finite in
the model's dtype once scaled: one NaN there would reach every row of a batch on a
dense product (layers/lora.py).

A request names the path (/v1/load_lora_adapter), so what a refusal says must not
let a client probe the server's disk: a missing directory, a file where a directory
should be, and a directory without a readable adapter_config.json all get one message,
and no message echoes a path, a value or a name read from the files (the server's log
has those, for its admin).  Whatever a library raises on a crafted file (a
RuntimeError, a MemoryError) is a refusal too, never a 500.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from pagedserve.utils import same_value

logger = logging.getLogger("pagedserve")

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20  # a PEFT config is a few hundred bytes
NOT_AN_ADAPTER = (f"lora_path is not a directory holding a PEFT adapter this server can read ({ADAPTER_CONFIG}, a "
                  f"JSON object of at most {MAX_CONFIG_BYTES} bytes, and {ADAPTER_WEIGHTS})")
_PREFIX = "base_model.model."
MAX_HEADER_BYTES = 16 << 20  # a safetensors header: ~150 bytes a tensor
_FLOAT_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1}  # safetensors' names
# Config keys that never change what a loaded adapter computes (training and
# initialisation settings, provenance; which modules are adapted is what the weights
# file holds, checked against the model): any value.  Every other key must be at a value
# that asks for nothing (null, false, empty) or, below, at its default: PEFT keeps adding
# options (aLoRA's invocation tokens, layer replication, QALoRA, ...), and one this
# code does not know is refused by name, never served as plain LoRA.
_INERT_OPTIONS = frozenset({
    "peft_type", "r", "lora_alpha", "use_rslora", "lora_dropout", "target_modules", "exclude_modules",
    "layers_to_transform", "layers_pattern", "base_model_name_or_path", "revision", "task_type",
    "inference_mode", "auto_mapping", "loftq_config", "eva_config", "corda_config", "megatron_config",
    "megatron_core", "peft_version", "ensure_weight_tying", "qalora_group_size", "runtime_config"})
# Config keys whose non-default value changes what the adapter computes, with the values
# that do not.  (init_lora_weights: PiSSA, OLoRA, CorDA and LoftQ change the base weights
# in training; PEFT writes True once such an adapter is converted to plain LoRA.)
_REFUSED_OPTIONS: dict[str, tuple[object, ...]] = {
    "init_lora_weights": (True, False, "gaussian", "eva", "orthogonal"),
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
    """An adapter that cannot be served.  Its message is what the client is told (no
    path, nothing read from the files); `detail`, what the server's log adds."""

    def __init__(self, message: str, detail: str | None = None) -> None:
        super().__init__(message)
        self.detail = detail


@dataclass
class PeftAdapter:
    """One adapter as its files have it: per module name (the base model's, e.g.
    "model.layers.0.self_attn.q_proj"), A [r, in] and B [out, r] as stored."""

    rank: int
    scaling: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]


def read_peft_adapter(path: str, max_rank: int, shapes: Mapping[str, tuple[int, int]],
                      dtype: torch.dtype = torch.float32) -> PeftAdapter:
    """The adapter in directory `path`; LoRAAdapterError saying what is wrong with it.
    `shapes`: each module the model can adapt (PEFT's name) -> its (in, out) features;
    `dtype`: the model's, in which the scaled weights must be finite."""
    with _refusals_logged(path):
        rank, scaling = _rank_and_scaling(_read_config(path), max_rank)
        return PeftAdapter(rank, scaling, _read_weights(path, rank, scaling, shapes, dtype))


def check_peft_config(path: str, max_rank: int) -> None:
    """The adapter's directory and config as read_peft_adapter checks them, without its
    weights (which need the model's shapes): LoRAAdapterError saying what is wrong."""
    with _refusals_logged(path):
        _rank_and_scaling(_read_config(path), max_rank)


@contextlib.contextmanager
def _refusals_logged(path: str) -> Iterator[None]:
    """An adapter's refusal, logged with what the client is not told; whatever the OS or a
    library raises on what a client named is a LoRAAdapterError (its 400)."""
    try:
        yield
    except LoRAAdapterError as e:
        logger.warning("LoRA adapter %r refused: %s", path, e.detail or e)
        raise
    except Exception as e:  # noqa: BLE001 - see the docstring
        logger.warning("LoRA adapter %r refused: %s: %s", path, type(e).__name__, e)
        raise LoRAAdapterError(NOT_AN_ADAPTER) from None


def adapter_files_key(path: str) -> tuple[int, ...] | None:
    """What identifies the adapter's files as they are now (each one's device, inode,
    size and modification time; None where one cannot be read): an id loaded again must
    find the files it was first loaded from, or KV cached under it would meet new weights."""
    try:
        stats = [os.stat(os.path.join(path, name)) for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS)]
    except (OSError, ValueError):
        return None
    return tuple(v for st in stats for v in (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))


def _read_config(path: str) -> dict:
    config_path = os.path.join(path, ADAPTER_CONFIG)
    if not os.path.isdir(path) or not os.path.isfile(config_path):
        raise LoRAAdapterError(NOT_AN_ADAPTER, "not a directory" if not os.path.isdir(path) else f"no {ADAPTER_CONFIG}")
    try:
        with open(config_path, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
        config = json.loads(raw) if len(raw) <= MAX_CONFIG_BYTES else None
    except (OSError, ValueError) as e:
        raise LoRAAdapterError(NOT_AN_ADAPTER, f"cannot read {ADAPTER_CONFIG}: {e}") from None
    if not isinstance(config, dict):
        raise LoRAAdapterError(NOT_AN_ADAPTER, f"{ADAPTER_CONFIG} is not a JSON object of at most "
                                               f"{MAX_CONFIG_BYTES} bytes")
    return config


def _rank_and_scaling(config: dict, max_rank: int) -> tuple[int, float]:
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoRAAdapterError("the adapter's peft_type is not LORA (only LoRA adapters are served)",
                               f"peft_type {peft_type!r}")
    for key, value in config.items():
        if key in _INERT_OPTIONS or (same_value(value, _REFUSED_OPTIONS[key]) if key in _REFUSED_OPTIONS
                                     else value is None or value is False or value in ({}, [], "")):
            continue
        why = "it changes the math and pagedserve does not implement it" if key in _REFUSED_OPTIONS else \
            "pagedserve does not know it, so it may change the math"
        raise LoRAAdapterError(f"adapter option {str(key)[:100]} is not supported ({why})", f"{key}={value!r}")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise LoRAAdapterError("adapter rank r must be a positive integer", f"r={rank!r}")
    if rank > max_rank:
        raise LoRAAdapterError(f"adapter rank r is over the maximum {max_rank} (--max-lora-rank)", f"r={rank}")
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise LoRAAdapterError("lora_alpha must be a finite number", f"lora_alpha={alpha!r}")
    rslora = config.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise LoRAAdapterError("use_rslora must be true or false", f"use_rslora={rslora!r}")
    return rank, float(alpha) / (math.sqrt(rank) if rslora else rank)


def _read_weights(path: str, rank: int, scaling: float, shapes: Mapping[str, tuple[int, int]],
                  dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    weights_path = os.path.join(path, ADAPTER_WEIGHTS)
    if not os.path.isfile(weights_path):
        pickled = os.path.isfile(os.path.join(path, "adapter_model.bin"))
        raise LoRAAdapterError(f"no {ADAPTER_WEIGHTS} in the adapter's directory" + (
            " (adapter_model.bin is a pickle, which pagedserve does not load: save the adapter with "
            "safe_serialization=True)" if pickled else ""))
    unreadable = f"{ADAPTER_WEIGHTS} is not a safetensors file this server can read"
    halves: dict[str, dict[str, torch.Tensor]] = {}
    try:
        # The header is read and checked here first: safetensors maps the whole file when
        # it opens it (a sparse one claiming 32 GiB: a RuntimeError).
        entries, size = _read_header(weights_path)
        for key, (shape, stored) in entries.items():
            module, half = _split_key(key)
            _check_header(key, module, half, shape, stored, rank, shapes)
            size += math.prod(shape) * _FLOAT_BYTES[stored]
        if os.path.getsize(weights_path) != size:
            raise LoRAAdapterError(unreadable, f"{os.path.getsize(weights_path)} bytes, its header says {size}")
        from safetensors import safe_open

        with safe_open(weights_path, framework="pt") as f:
            for key in entries:
                module, half = _split_key(key)
                halves.setdefault(module, {})[half] = f.get_tensor(key)
    except LoRAAdapterError:
        raise
    except Exception as e:  # noqa: BLE001 - a crafted file makes safetensors or torch raise anything
        raise LoRAAdapterError(unreadable, f"{type(e).__name__}: {e}") from None
    weights = {}
    for module, pair in halves.items():
        if set(pair) != {"lora_A", "lora_B"}:
            raise LoRAAdapterError("an adapted module does not have both lora_A and lora_B", module)
        a, b = pair["lora_A"], pair["lora_B"]
        if not (torch.isfinite(a.to(dtype)).all() and torch.isfinite((b.float() * scaling).to(dtype)).all()):
            raise LoRAAdapterError(f"the adapter's weights are not all finite in {str(dtype).removeprefix('torch.')} "
                                   "once scaled (NaN or infinity)", module)
        weights[module] = (a, b)
    if not weights:
        raise LoRAAdapterError(f"{ADAPTER_WEIGHTS} holds no LoRA weights")
    return weights


def _read_header(weights_path: str) -> tuple[dict[str, tuple[tuple[int, ...], str]], int]:
    """(tensor name -> (shape, dtype), the header's bytes) of a safetensors file: a
    little-endian u64 length, then that much JSON."""
    with open(weights_path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        if length > MAX_HEADER_BYTES:
            raise ValueError(f"a header of {length} bytes")
        header = json.loads(f.read(length))
    entries = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        shape = tuple(info["shape"])
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise ValueError(f"tensor {key!r} has shape {shape}")
        entries[key] = (shape, info["dtype"])
    return entries, 8 + length


def _check_header(key: str, module: str, half: str, shape: tuple[int, ...], dtype: str, rank: int,
                  shapes: Mapping[str, tuple[int, int]]) -> None:
    """One tensor, as the file's header describes it, against the model's layer; before it is read."""
    if module not in shapes:
        leaves = sorted({n.rpartition(".")[2] for n in shapes})
        raise LoRAAdapterError(f"the adapter targets a module that is not a linear layer of this model (adaptable: "
                               f"{', '.join(leaves)})", key)
    if len(shape) != 2 or shape[0 if half == "lora_A" else 1] != rank:
        raise LoRAAdapterError("a tensor is not a rank-r LoRA matrix (lora_A [r, in] and lora_B [out, r], r as "
                               f"{ADAPTER_CONFIG} says)", f"{key} {shape}, r={rank}")
    in_features, out_features = shapes[module]
    if shape[1 if half == "lora_A" else 0] != (in_features if half == "lora_A" else out_features):
        raise LoRAAdapterError("a tensor's shape is not that of this model's layer (an adapter of another base "
                               "model?)", f"{key} {shape}, the layer takes [{in_features} in, {out_features} out]")
    if dtype not in _FLOAT_BYTES:
        raise LoRAAdapterError("the adapter's weights must be floating point", f"{key} {dtype}")


def _split_key(key: str) -> tuple[str, str]:
    """'base_model.model.<module>.lora_A.weight' -> (<module>, 'lora_A')."""
    name = key[len(_PREFIX):] if key.startswith(_PREFIX) else key
    parts = name.split(".")
    if any(p in ("lora_embedding_A", "lora_embedding_B", "embed_tokens", "lm_head") for p in parts):
        raise LoRAAdapterError("the adapter adapts the embedding or LM head, which pagedserve does not implement "
                               "(only attention and MLP projections)", key)
    if len(parts) >= 3 and parts[-1] == "weight" and parts[-2] in ("lora_A", "lora_B"):
        return ".".join(parts[:-2]), parts[-2]
    raise LoRAAdapterError("the adapter has a tensor that is not a LoRA weight (<module>.lora_A.weight / "
                           "<module>.lora_B.weight)", key)

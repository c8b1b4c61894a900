"""Checkpoint-to-parameter plumbing shared by every model family.

A checkpoint names tensors the HF way (q_proj, k_proj, ...); our modules fuse some of
them (qkv_proj, gate_up_proj).  `load_named_weights` routes each tensor to its
parameter's `weight_loader` with the right shard id and then checks coverage, so a
missing or stray tensor is reported by its checkpoint name instead of leaving a
parameter silently uninitialised.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from pagedserve.layers.linear import LinearBase, default_weight_loader

# (fused parameter name, checkpoint name, shard id)
StackedMapping = list[tuple[str, str, object]]


def load_named_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked: StackedMapping,
    skip: Callable[[str], bool] = lambda name: False,
) -> set[str]:
    """Load (name, tensor) pairs into `model`; returns the checkpoint names used.

    Raises ValueError naming the tensor on a shape mismatch, on tensors the model has
    no place for, and on parameters (or fused shards) the checkpoint did not provide.
    """
    params = dict(model.named_parameters())
    filled: dict[str, set] = defaultdict(set)
    used: set[str] = set()
    unexpected: list[str] = []
    for name, tensor in weights:
        if skip(name):
            continue
        target, shard = name, None
        for fused, original, shard_id in stacked:
            if f".{original}." in name:
                target, shard = name.replace(f".{original}.", f".{fused}."), shard_id
                break
        param = params.get(target)
        if param is None:
            unexpected.append(name)
            continue
        if (isinstance(tensor, torch.Tensor) and param.is_floating_point()
                and tensor.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64)):
            raise ValueError(f"checkpoint tensor {name!r} is {tensor.dtype}, not a 16-, 32- or 64-bit float: integer "
                             "or 8-bit float weights belong to a quantized checkpoint, which is not read here")
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            loader(param, tensor, shard)
        except ValueError as e:
            raise ValueError(f"checkpoint tensor {name!r}: {e}") from None
        filled[target].add(shard)
        used.add(name)
    if unexpected:
        raise ValueError(
            f"checkpoint has {len(unexpected)} tensor(s) this model does not use "
            f"(config and weights disagree?): {', '.join(sorted(unexpected)[:8])}"
        )
    missing = []
    for pname, param in params.items():
        for shard in getattr(param, "shard_ids", [None]):
            if shard not in filled[pname]:
                missing.append(_checkpoint_name(pname, shard, stacked))
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensor(s): {', '.join(missing[:8])}")
    return used


def _checkpoint_name(param_name: str, shard: object, stacked: StackedMapping) -> str:
    for fused, original, shard_id in stacked:
        if shard is not None and shard == shard_id and f".{fused}." in param_name:
            return param_name.replace(f".{fused}.", f".{original}.")
    return param_name


@runtime_checkable
class DirectBindable(Protocol):
    """A layer that can run its eager forward as direct kernel calls (LlamaDecoderLayer,
    Gemma3DecoderLayer)."""

    def bind_direct(self) -> bool: ...


def direct_projections(*linears: LinearBase) -> list[Callable[[torch.Tensor], torch.Tensor]] | None:
    """Each projection's direct call (LinearBase.direct_call), for a layer's direct calls
    (bind_direct); None unless every one has one (one rank)."""
    calls = []
    for lin in linears:
        call = lin.direct_call()
        if call is None:
            return None
        calls.append(call)
    return calls


@runtime_checkable
class StackBindable(Protocol):
    """A decoder whose all-decode steps can run its layers as one C++ call (LlamaModel)."""

    def bind_decode_stack(self) -> bool: ...


def bind_decode_stacks(model: nn.Module) -> int:
    """Bind every decoder of `model` that can run its layers as one C++ call (after
    bind_direct_layers, with the KV cache allocated); how many did."""
    return sum(m.bind_decode_stack() for m in model.modules() if isinstance(m, StackBindable))


def bind_direct_layers(model: nn.Module) -> tuple[int, int]:
    """Bind every layer of `model` that can run as direct kernel calls: (how many did,
    how many could have).  The caller's part: a CPU model whose layers will not change
    (adapters are attached before, at load); a compile traces the layers' module path
    regardless."""
    layers = [m for m in model.modules() if isinstance(m, DirectBindable)]
    return sum(m.bind_direct() for m in layers), len(layers)


def load_plain_weights(module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                       skip: Callable[[str], bool] = lambda name: False, prefix: str = "") -> set[str]:
    """Copy (name, tensor) pairs into `module`'s parameters of the same names, checking
    shapes and coverage: load_named_weights is for the decoder's fused parallel layers,
    this for plain modules (vision towers, projectors).  `prefix`: the module's place in
    the checkpoint, for the messages."""
    params = dict(module.named_parameters())
    used: set[str] = set()
    unexpected: list[str] = []
    for name, tensor in weights:
        if skip(name):
            continue
        param = params.get(name)
        if param is None:
            unexpected.append(name)
            continue
        if tuple(param.shape) != tuple(tensor.shape):
            raise ValueError(f"checkpoint tensor {prefix + name!r}: shape {tuple(tensor.shape)}, "
                             f"the model expects {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(tensor)
        used.add(name)
    if unexpected:
        raise ValueError(f"checkpoint has {len(unexpected)} tensor(s) this model does not use "
                         f"(config and weights disagree?): {', '.join(prefix + n for n in sorted(unexpected)[:8])}")
    missing = sorted(set(params) - used)
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensor(s): {', '.join(prefix + n for n in missing[:8])}")
    return used


def loaded_embedding(rows: int, dim: int) -> nn.Embedding:
    """An nn.Embedding whose table the checkpoint (or the dummy initializer) fills: no
    random init first.  That init's normal_ on the meta device (the loader sizes a model
    there) imports torch._dynamo, 1.2 s of a start."""
    return nn.Embedding(rows, dim, _weight=torch.empty(rows, dim))

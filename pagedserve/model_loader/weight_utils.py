"""Reading safetensors checkpoints with errors that name the file, and dummy weights.

A truncated or corrupt file must surface as "this file is broken", not as an error
from deep inside safetensors or torch halfway through building the model.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator

import torch
from torch import nn

from pagedserve.layers.layernorm import RMSNorm


def safetensors_files(model_dir: str) -> list[str]:
    """The checkpoint's *.safetensors files (the index's shards when there is an index)."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{index}: unreadable safetensors index ({e})") from None
        files = [os.path.join(model_dir, s) for s in shards]
        absent = [f for f in files if not os.path.isfile(f)]
        if absent:
            raise FileNotFoundError(f"{index} lists weight files that do not exist: {', '.join(absent)}")
        return files
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        other = [os.path.basename(p) for p in glob.glob(os.path.join(model_dir, "*.bin"))]
        hint = f" (found {', '.join(other)}: PyTorch .bin checkpoints are not supported, convert to safetensors)" \
            if other else ""
        raise FileNotFoundError(f"no *.safetensors weight files in {model_dir}{hint}")
    return files


class LazySlice:
    """A checkpoint tensor not read yet.  `narrow` reads only the rows (or columns) it
    asks for, which is how a tensor-parallel rank loads its shard without ever holding
    the whole tensor; any other torch use (`param.copy_(t)` for a replicated weight)
    reads it all, through `__torch_function__`."""

    def __init__(self, handle: object, name: str, path: str) -> None:
        self.name, self.path = name, path
        self._slice = handle.get_slice(name)
        self.shape = torch.Size(self._slice.get_shape())

    def dim(self) -> int:
        return len(self.shape)

    def size(self, dim: int | None = None) -> torch.Size | int:
        return self.shape if dim is None else self.shape[dim]

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        return self._read((slice(None),) * dim + (slice(start, start + length),))

    def materialize(self) -> torch.Tensor:
        return self._read((slice(None),) * self.dim())

    def _read(self, index: tuple) -> torch.Tensor:
        try:
            return self._slice[index]
        except Exception as e:
            raise ValueError(f"{self.path}: cannot read tensor {self.name!r} ({type(e).__name__}: {e})") from None

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        def real(a: object) -> object:  # (inside lists too: torch.cat of a MoE's per-expert tensors)
            if isinstance(a, (list, tuple)):
                return [real(x) for x in a] if isinstance(a, list) else tuple(real(x) for x in a)
            return a.materialize() if isinstance(a, LazySlice) else a

        return func(*map(real, args), **{k: real(v) for k, v in (kwargs or {}).items()})


def iter_safetensors(files: list[str], lazy: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every file; a corrupt file is a ValueError naming it.
    With `lazy`, tensors come as LazySlice (read on narrow/use) instead of being read whole."""
    from safetensors import safe_open

    for path in files:
        try:
            handle = safe_open(path, framework="pt", device="cpu")
            names = list(handle.keys())
        except Exception as e:
            raise ValueError(f"{path}: corrupt or truncated safetensors file ({type(e).__name__}: {e})") from None
        for name in names:
            try:
                tensor = LazySlice(handle, name, path) if lazy else handle.get_tensor(name)
            except Exception as e:
                raise ValueError(f"{path}: cannot read tensor {name!r} ({type(e).__name__}: {e})") from None
            yield name, tensor


@torch.no_grad()
def initialize_dummy_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Random weights for benchmarks: N(0, std) matrices, zero biases, unit norms.

    A small std keeps activations and logits finite through many layers in bf16.
    """
    generators: dict[torch.device, torch.Generator] = {}
    seen: set[int] = set()
    for module in model.modules():
        for param in module.parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            if isinstance(module, RMSNorm):
                param.fill_(1.0)
            elif param.dim() == 1:
                param.zero_()
            else:
                gen = generators.get(param.device)
                if gen is None:
                    gen = generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
                param.normal_(0.0, std, generator=gen)

"""Pick the attention backend class by name, or the best one for the device."""

from __future__ import annotations

import importlib
import logging

import torch

from pagedserve.attention.backend import AttentionBackend
from pagedserve.platforms import is_cpu, is_cuda

logger = logging.getLogger(__name__)

# name -> "module:Class"; imported lazily so that a missing optional dependency
# (triton) only matters when that backend is asked for.
BACKENDS: dict[str, str] = {
    "cpu_paged": "pagedserve.attention.cpu_paged:CpuPagedBackend",
    "torch_paged": "pagedserve.attention.torch_paged:TorchPagedBackend",
    "torch_ref": "pagedserve.attention.torch_ref:TorchReferenceBackend",
    "triton": "pagedserve.attention.triton_backend:TritonAttentionBackend",
}


def _load(name: str) -> type[AttentionBackend]:
    module, cls = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def get_attn_backend(name: str | None, device: torch.device | str) -> type[AttentionBackend]:
    """`name` None picks triton on CUDA when it imports, else cpu_paged (torch_paged plus a
    native decode kernel, which falls back to torch_paged's path where it cannot be built)."""
    device = torch.device(device)
    if name is None:
        if is_cuda(device):
            try:
                return _load("triton")
            except ImportError:
                pass
        return _load("cpu_paged" if is_cpu(device) else "torch_paged")
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(sorted(BACKENDS))}")
    if name == "torch_paged" and is_cpu(device):
        logger.warning("attention backend torch_paged attends prompt rows on blocked paths: answers can depend on "
                       "chunking and batching (cpu_paged, the default on CPU, attends them as decode rows)")
    try:
        return _load(name)
    except ImportError as e:
        raise ValueError(f"attention backend {name!r} is not available here: {e}") from None

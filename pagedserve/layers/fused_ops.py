"""Where the layers run fused Triton kernels (layers/triton_fused.py) instead of their torch ops.

On CUDA tensors, when triton is installed: there the unfused elementwise ops are a
fifth of a decode step.  Elsewhere the torch ops run (the CPU has its own compiled
path), and triton is not even imported, since importing it fixes interpreted or
compiled mode for the whole process.  `OVERRIDE` lets a test choose: True runs the
kernels on CPU tensors too (under TRITON_INTERPRET=1), through the model code itself;
False runs the torch ops on CUDA, as the reference the kernels are checked against
(PAGEDSERVE_FUSED_KERNELS=0 sets it for a process, to measure what the kernels buy).
"""

from __future__ import annotations

import functools
import importlib.machinery
import os
from types import ModuleType

import torch

# None: the kernels on CUDA tensors only.
OVERRIDE: bool | None = False if os.environ.get("PAGEDSERVE_FUSED_KERNELS") == "0" else None


@functools.cache
def _triton_installed() -> bool:
    # On the path, not through sys.modules: a CPU compile hides Triton there for a while
    # (worker/compiled_model.py), and this answer is kept for the process.
    return importlib.machinery.PathFinder.find_spec("triton") is not None


def applies(x: torch.Tensor) -> bool:
    """Whether the layer computing on `x` uses the fused kernels."""
    wanted = x.is_cuda if OVERRIDE is None else OVERRIDE
    return wanted and _triton_installed()


@functools.cache
def kernels() -> ModuleType:
    """layers.triton_fused, imported on first use."""
    from pagedserve.layers import triton_fused

    return triton_fused

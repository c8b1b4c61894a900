"""Which fused kernels run the layers' elementwise work on a tensor, if any.

The layers (RMSNorm, SiluAndMul, rotary's q/k) ask `kernels_for(x)` and call the
module it names, or their own torch ops on None.  Both kernel sets have one interface
(rms_norm, norm_rope, silu_and_mul) and round where the torch ops round:
  * CUDA tensors, where triton is installed: layers/triton_fused.py.  There the unfused
    elementwise ops are a fifth of a decode step.
  * 16-bit CPU tensors: layers/cpu_fused.py (C++), unless a torch.compile trace is
    running (inductor fuses the torch ops itself, and its graph must not change).  On a
    small model the unfused ops' dispatch is most of an eager step.  float32 keeps the
    torch ops, whose order of a row's sum of squares is HF's (bit-exact parity).
Triton is not imported for CPU tensors: importing it fixes interpreted or compiled mode
for the whole process.  `OVERRIDE` lets a test choose: True runs the Triton kernels on
CPU tensors too (under TRITON_INTERPRET=1), through the model code itself; False runs
the torch ops everywhere, as the reference the kernels are checked against
(PAGEDSERVE_FUSED_KERNELS=0 sets it for a process, to measure what the kernels buy).
"""

from __future__ import annotations

import functools
import importlib.machinery
import logging
import os
from types import ModuleType

import torch

# None: Triton on CUDA tensors, C++ on 16-bit CPU ones.
OVERRIDE: bool | None = False if os.environ.get("PAGEDSERVE_FUSED_KERNELS") == "0" else None
_CPU_DTYPES = (torch.bfloat16, torch.float16)


@functools.cache
def _triton_installed() -> bool:
    # On the path, not through sys.modules: a CPU compile hides Triton there for a while
    # (worker/compiled_model.py), and this answer is kept for the process.
    return importlib.machinery.PathFinder.find_spec("triton") is not None


def kernels_for(x: torch.Tensor, *others: torch.Tensor) -> ModuleType | None:
    """The kernel module for the layer computing on `x` (with `others`: its weights, the
    residual, ...), or None for its torch ops.  The C++ kernels take one dtype for all
    their tensors; anything mixed keeps the torch ops and their type promotion.  Called
    ~200 times a decode step: the CPU case is tested first and cheaply."""
    if OVERRIDE is None and x.is_cpu:
        dtype = x.dtype
        if dtype not in _CPU_DTYPES or torch.compiler.is_compiling():
            return None
        for t in others:
            if t.dtype != dtype:
                return None
        return _cpu()
    if OVERRIDE is False or not (OVERRIDE or x.is_cuda):
        return None
    return _triton() if _triton_installed() else None


@functools.cache
def _triton() -> ModuleType:
    from pagedserve.layers import triton_fused

    return triton_fused


@functools.cache
def _cpu() -> ModuleType | None:
    """layers.cpu_fused once its kernel is built, None where it cannot be (no compiler:
    the torch ops run, as they always could)."""
    from pagedserve.layers import cpu_fused

    error = cpu_fused.fused_kernel_error()
    if error is not None:
        logging.getLogger("pagedserve").warning("fused CPU kernels unavailable, the layers run their torch ops "
                                                "(%s)", error)
    return cpu_fused if error is None else None


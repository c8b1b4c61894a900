"""Which fused kernels run the layers' elementwise work on a tensor, if any.

The layers (RMSNorm, SiluAndMul, rotary's q/k) ask `kernels_for(x)` and call the
kernel set it names, or their own torch ops on None.  Both kernel sets have one
interface (`FusedKernels`: rms_norm, norm_rope, silu_and_mul) and round where the
torch ops round (a reduction's order aside: see the C++ set):
  * CUDA tensors, where triton is installed: layers/triton_fused.py.  There the unfused
    elementwise ops are a fifth of a decode step.
  * float32, bfloat16 and float16 CPU tensors: layers/cpu_fused.py (C++), unless a
    torch.compile trace is running (inductor fuses the torch ops itself, and its graph
    must not change).  On a small model the unfused ops' dispatch is most of an eager
    step.  In float32 the kernels differ from the torch ops only in the order of a row's
    sum of squares and in exp's last bits (within float32 noise of HF's logits).  In
    16-bit dtypes that order can move a norm's output by one rounding step, so where two
    tokens nearly tie a greedy answer can differ from the torch ops' (the kernels are the
    default and what the answers are tested as; a machine without a compiler runs the
    torch ops and says so at start; PAGEDSERVE_FUSED_KERNELS=0 runs them on purpose).
Gemma's layers (GemmaRMSNorm, GeluTanhAndMul, its q/k norms) ask `gemma_kernels_for`:
only the C++ set has their kernels (`GemmaKernels`), so CUDA runs their torch ops.
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
from typing import Protocol

import torch

from pagedserve import envs

# None: Triton on CUDA tensors, C++ on CPU ones.
OVERRIDE: bool | None = False if envs.fused_kernels() is False else None
_CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class FusedKernels(Protocol):
    """What both kernel sets (layers/cpu_fused.py, layers/triton_fused.py) provide."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...

    def norm_rope(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
                  num_kv_heads: int, head_dim: int, rotary_dim: int,
                  norm_weights: tuple[torch.Tensor, torch.Tensor] | None, eps: float
                  ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor: ...


class GemmaKernels(FusedKernels, Protocol):
    """The C++ set's Gemma kernels besides: its RMSNorm ((1 + weight), the residual added
    after the norm), its q/k norms before rotary, GELU-tanh x up."""

    def gemma_rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                       residual: torch.Tensor | None = None) -> torch.Tensor: ...

    def norm_rope(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
                  num_kv_heads: int, head_dim: int, rotary_dim: int,
                  norm_weights: tuple[torch.Tensor, torch.Tensor] | None, eps: float, gemma: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor: ...


@functools.cache
def _triton_installed() -> bool:
    # On the path, not through sys.modules: a CPU compile hides Triton there for a while
    # (worker/compiled_model.py), and this answer is kept for the process.
    return importlib.machinery.PathFinder.find_spec("triton") is not None


def kernels_for(x: torch.Tensor, *others: torch.Tensor) -> FusedKernels | None:
    """The kernel set for the layer computing on `x` (with `others`: its weights, the
    residual, ...), or None for its torch ops.  Called ~200 times a decode step: the CPU
    case is tested first and cheaply."""
    if OVERRIDE is None and x.is_cpu:
        return _cpu_for(x, others)
    if OVERRIDE is False or not (OVERRIDE or x.is_cuda):
        return None
    return _triton() if _triton_installed() else None


def gemma_kernels_for(x: torch.Tensor, *others: torch.Tensor) -> GemmaKernels | None:
    """kernels_for for Gemma's layers: the C++ set on CPU tensors, else None (no Triton
    twins: CUDA, and a test forcing Triton, run Gemma's torch ops)."""
    return _cpu_for(x, others) if OVERRIDE is None and x.is_cpu else None


def _cpu_for(x: torch.Tensor, others: tuple[torch.Tensor, ...]) -> GemmaKernels | None:
    """The C++ kernels take one dtype for all their tensors; anything mixed keeps the
    torch ops and their type promotion."""
    dtype = x.dtype
    if dtype not in _CPU_DTYPES or torch.compiler.is_compiling():
        return None
    for t in others:
        if t.dtype != dtype:
            return None
    return _cpu()


def is_cpu_set(kernels: FusedKernels | None) -> bool:
    """Whether `kernels` (a kernels_for answer) is the C++ set, which C++ callers
    (layers/decode_stack.py) can call in its place."""
    return kernels is not None and kernels is _cpu()


@functools.cache
def _triton() -> FusedKernels:
    from pagedserve.layers import triton_fused

    return triton_fused


@functools.cache
def _cpu() -> GemmaKernels | None:
    """layers.cpu_fused once its kernel is built, None where it cannot be (no compiler:
    the torch ops run, as they always could)."""
    from pagedserve.layers import cpu_fused

    error = cpu_fused.fused_kernel_error()
    if error is not None:
        logging.getLogger("pagedserve").warning(
            "fused CPU kernels unavailable, the layers run their torch ops (%s); in 16-bit dtypes their norms round "
            "a sum differently, so greedy answers can differ from a machine that builds the kernels at near-ties",
            error)
    return cpu_fused if error is None else None


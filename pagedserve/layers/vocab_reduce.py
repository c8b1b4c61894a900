"""The two reductions over a vocabulary-wide row that every step makes: the row's largest
logit and where it first occurs (the sampler's greedy choice and its validity check), and
the indices of the k largest (ParallelLMHead's exact top logits, the top logprobs).

Why not torch's own: on CPU `x.max(-1)` (with indices) and `x.topk(k)` walk a row on one
thread, a scalar element at a time: for Gemma 3's 262,144-token vocabulary they took
0.17 and 0.37 ms of a 9 ms single-stream step (Zen 5).  So float32 CPU rows go to the
fused kernels' `row_max` and `row_topk` (layers/csrc/fused_cpu.cpp): one pass of vector
compares per row, looking inside a 64-wide chunk only when it can hold the answer.  The
results are torch's: the same maximum and first index, and the same top-k values (which
of several equal values at the k-th place is chosen may differ).  One row of SmolLM2's
49,152 logits, 2 threads of a Zen 2: max 85 -> 10 us and top-8 83 -> 17 us against the
blocked torch version this file had (each block's amax, then a look inside the few
blocks that can hold the answer: ~10 small ops, most of their time dispatch).  Other
dtypes and devices, a k past the kernel's, traced code, and a machine where the kernels
do not build keep torch's ops.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from pagedserve.layers.cpu_fused import fused_kernel, fused_kernel_error


@functools.cache
def _kernel() -> ModuleType | None:
    """The fused kernels, or None where they do not build (no compiler: torch's ops)."""
    return fused_kernel() if fused_kernel_error() is None else None


def _native(x: torch.Tensor) -> ModuleType | None:
    """The kernels if they take `x`: float32 [N, V] CPU rows with unit column stride."""
    if (x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] == 0
            or x.stride(1) != 1 or torch.compiler.is_compiling()):
        return None
    return _kernel()


def row_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x.max(-1)` of [N, V] rows: each row's maximum and the first index holding it (NaN
    in a row: NaN, and a NaN's index)."""
    kernel = _native(x)
    if kernel is None:
        values, indices = x.max(-1)
        return values, indices
    return kernel.row_max(x)


def row_topk_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """[N, k] distinct indices of each row's k largest values (as `x.topk(k).indices`, in
    no particular order; NaN counts as largest, as in topk)."""
    k = min(k, x.shape[1])
    kernel = _native(x)
    if kernel is None or not 1 <= k <= kernel.MAX_TOPK:
        return x.topk(k, dim=-1).indices
    return kernel.row_topk(x, k)

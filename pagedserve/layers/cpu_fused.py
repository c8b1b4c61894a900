"""The decoder's fused elementwise kernels on CPUs (layers/csrc/fused_cpu.cpp), with
triton_fused's interface: residual add + RMSNorm, q/k RMSNorm + rotary, SiLU x up.

The eager model on 16-bit CPU tensors calls these where `fused_ops.kernels_for` says so;
they round where the torch ops they replace round (the C++ file says how they differ).
The kernel is built once per machine like our others (cpu_extension.py).
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import torch

from pagedserve.cpu_extension import CpuKernel
from pagedserve.layers.fused_rows import as_rows

_KERNEL = CpuKernel("pagedserve_fused_cpu", Path(__file__).parent / "csrc" / "fused_cpu.cpp",
                    "fused elementwise kernels", "fused kernels")


def fused_kernel(extra_cflags: tuple[str, ...] | None = None) -> ModuleType:
    """The compiled kernels for this machine (built once, cached; see cpu_extension.py);
    `extra_cflags` builds another variant (tests: the AVX2 path)."""
    return _KERNEL.get(extra_cflags)


def fused_kernel_error() -> str | None:
    """None when the kernels build (or are built) here, else why not."""
    return _KERNEL.error()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """layernorm.RMSNorm.forward over [..., N] rows."""
    n = x.shape[-1]
    res = as_rows(residual, n) if residual is not None else None
    out, new_residual = _KERNEL.get().rms_norm(as_rows(x, n), weight, eps, res)
    if x.dim() != 2:
        out = out.view(x.shape)
        new_residual = new_residual.view(x.shape) if residual is not None else None
    return out if residual is None else (out, new_residual)


def norm_rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
              head_dim: int, rotary_dim: int, norm_weights: tuple[torch.Tensor, torch.Tensor] | None,
              eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """qkv [T, (H + 2 KVH) * D] (rows may be strided) -> rotated q [T, H, D] and k
    [T, KVH, D], each head first RMS-normalised with `norm_weights` (q's, k's) if given."""
    qw, kw = norm_weights if norm_weights is not None else (None, None)
    return _KERNEL.get().norm_rope(as_rows(qkv, qkv.shape[-1]), cos, sin, num_heads, num_kv_heads, head_dim,
                                   rotary_dim, qw, kw, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """activation.SiluAndMul over [..., 2I] rows."""
    n = x.shape[-1] // 2
    out = _KERNEL.get().silu_and_mul(as_rows(x, 2 * n))
    return out if x.dim() == 2 else out.view(*x.shape[:-1], n)

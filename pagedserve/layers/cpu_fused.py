"""The decoder's fused elementwise kernels on CPUs (layers/csrc/fused_cpu.cpp), with
triton_fused's interface: residual add + RMSNorm, q/k RMSNorm + rotary, SiLU x up; and
Gemma's RMSNorm (with the residual add after it) and GELU-tanh x up, which have no
Triton twins.

The eager model on float32, bfloat16 and float16 CPU tensors calls these where
`fused_ops.kernels_for` says so; they round where the torch ops they replace round (the
C++ file says how they differ).  The kernel is built once per machine like our others
(cpu_extension.py), without floating-point contraction: an FMA would round a float32
a*b + c*d once where torch rounds it twice.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import torch

from pagedserve.cpu_extension import CpuKernel
from pagedserve.layers.fused_rows import as_rows

_KERNEL = CpuKernel("pagedserve_fused_cpu", Path(__file__).parent / "csrc" / "fused_cpu.cpp",
                    "fused elementwise kernels", "fused kernels", cflags=("-ffp-contract=off", "-fno-trapping-math"))


def fused_kernel(extra_cflags: tuple[str, ...] | None = None) -> ModuleType:
    """The compiled kernels for this machine (built once, cached; see cpu_extension.py);
    `extra_cflags` builds another variant (tests: the AVX2 path)."""
    return _KERNEL.get(extra_cflags)


def fused_kernel_error() -> str | None:
    """None when the kernels build (or are built) here, else why not."""
    return _KERNEL.error()


def _as_input_shape(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return out if x.dim() == 2 else out.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """layernorm.RMSNorm.forward over [..., N] rows."""
    n = x.shape[-1]
    res = as_rows(residual, n) if residual is not None else None
    out, new_residual = _KERNEL.get().rms_norm(as_rows(x, n), weight, eps, res)
    if residual is None:
        return _as_input_shape(out, x)
    return _as_input_shape(out, x), _as_input_shape(new_residual, x)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   residual: torch.Tensor | None = None) -> torch.Tensor:
    """layernorm.GemmaRMSNorm.forward over [..., N] rows: norm(x) scaled by (1 + weight),
    plus `residual` after the norm where given (Gemma's sub-blocks are normed, then added)."""
    n = x.shape[-1]
    res = as_rows(residual, n) if residual is not None else None
    return _as_input_shape(_KERNEL.get().gemma_rms_norm(as_rows(x, n), weight, eps, res), x)


def norm_rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
              head_dim: int, rotary_dim: int, norm_weights: tuple[torch.Tensor, torch.Tensor] | None,
              eps: float, gemma: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """qkv [T, (H + 2 KVH) * D] (rows may be strided) -> rotated q [T, H, D] and k
    [T, KVH, D], each head first RMS-normalised with `norm_weights` (q's, k's) if given:
    Llama's RMSNorm, or Gemma's (1 + weight) where `gemma`."""
    qw, kw = norm_weights if norm_weights is not None else (None, None)
    return _KERNEL.get().norm_rope(as_rows(qkv, qkv.shape[-1]), cos, sin, num_heads, num_kv_heads, head_dim,
                                   rotary_dim, qw, kw, eps, gemma)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """activation.SiluAndMul over [..., 2I] rows."""
    n = x.shape[-1] // 2
    out = _KERNEL.get().silu_and_mul(as_rows(x, 2 * n))
    return out if x.dim() == 2 else out.view(*x.shape[:-1], n)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """activation.GeluTanhAndMul over [..., 2I] rows."""
    n = x.shape[-1] // 2
    out = _KERNEL.get().gelu_tanh_and_mul(as_rows(x, 2 * n))
    return out if x.dim() == 2 else out.view(*x.shape[:-1], n)

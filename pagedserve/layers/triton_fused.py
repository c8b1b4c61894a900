"""Fused Triton kernels for the decoder's elementwise work on CUDA.

Unfused, one layer of a Llama/Qwen3 decoder runs some 35 small kernels besides its
GEMMs and attention: each RMSNorm is an add, a cast, a square, a mean, an rsqrt and
two multiplies; q/k-norm and rotary as many again; SiLU x up two more.  At batch 256
on an H100 they took 2.6 ms of a 12.8 ms decode step (docs/gpu_notes.md), and under
CUDA graphs each one still costs its launch slot.  Here each becomes one kernel:
residual add + RMSNorm, q/k RMSNorm + rotary for every head of a token, and SiLU x up.

Each kernel rounds where the torch ops it replaces round (after the add, after the
normalisation, after each product), so a kernel differs from them only in the order
of a row's sum of squares.  The layers call these only where `fused_ops.kernels_for`
says so (CUDA tensors; 16-bit CPU tensors have C++ twins in cpu_fused.py), and tests
run these bodies under the Triton interpreter against the torch ops.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch
import triton
import triton.language as tl

from pagedserve.attention.triton_kernels import wrap_for_mode
from pagedserve.layers.fused_rows import as_rows


def rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_r, stride_o, stride_ro, n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    """One row per program: (x + residual) stored rounded to the residual's dtype, then
    weight * (normalised sum rounded to x's dtype), as layernorm.RMSNorm computes it."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        x = (x + r).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
        x = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    normed = (x * inv).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def norm_rope_kernel(
    qkv_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, q_out_ptr, k_out_ptr, stride_t, stride_ct, eps,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, HAS_NORM: tl.constexpr,
):
    """One (token, head) per program over q's heads then k's: optionally the head's
    RMSNorm (Qwen3's q_norm / k_norm), then rotary in the neox layout with the step's
    per-token cos and signed sin ([T, 1, ROT_DIM], RotaryEmbedding.cos_sin).  The
    swapped half is loaded (and normalised) a second time rather than shuffled in
    registers; each product is rounded before the add, as RotaryEmbedding.rotate does."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    ok = d < HEAD_DIM
    half = ROT_DIM // 2
    swapped = tl.where(d < ROT_DIM, tl.where(d < half, d + half, d - half), d)
    src = qkv_ptr + t * stride_t + h * HEAD_DIM  # k's heads follow q's in the fused projection
    if h < NUM_HEADS:
        w_ptr = qw_ptr
        dst = q_out_ptr + t * (NUM_HEADS * HEAD_DIM) + h * HEAD_DIM
    else:
        w_ptr = kw_ptr
        dst = k_out_ptr + t * (NUM_KV_HEADS * HEAD_DIM) + (h - NUM_HEADS) * HEAD_DIM
    dt = q_out_ptr.dtype.element_ty
    x = tl.load(src + d, mask=ok, other=0.0).to(tl.float32)
    xs = tl.load(src + swapped, mask=ok, other=0.0).to(tl.float32)
    if HAS_NORM:
        inv = tl.rsqrt(tl.sum(x * x, axis=0) / HEAD_DIM + eps)
        w = tl.load(w_ptr + d, mask=ok, other=0.0).to(tl.float32)
        ws = tl.load(w_ptr + swapped, mask=ok, other=0.0).to(tl.float32)
        x = (w * (x * inv).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        xs = (ws * (xs * inv).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    rot = d < ROT_DIM  # past the rotary part (partial rotary): cos 1, sin 0 pass x through
    cos = tl.load(cos_ptr + t * stride_ct + d, mask=rot, other=1.0).to(tl.float32)
    sin = tl.load(sin_ptr + t * stride_ct + d, mask=rot, other=0.0).to(tl.float32)
    y = (x * cos).to(dt).to(tl.float32) + (xs * sin).to(dt).to(tl.float32)
    tl.store(dst + d, y.to(dt), mask=ok)


def silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, n_cols, BLOCK: tl.constexpr):
    """silu(gate) rounded, times up rounded; the gate half comes first in each row."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (act * up).to(dt), mask=mask)


_BODIES = (rms_norm_kernel, norm_rope_kernel, silu_and_mul_kernel)


@functools.cache
def get_kernels() -> SimpleNamespace:
    return wrap_for_mode(_BODIES)


def _warps(block: int) -> int:
    return max(1, min(16, block // 256))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """layernorm.RMSNorm.forward over [T, N] rows."""
    n = x.shape[-1]
    x2 = as_rows(x, n)
    out = torch.empty(x2.shape, dtype=torch.result_type(weight, x), device=x.device)
    # Without a residual the kernel neither reads nor writes one: x and out stand in.
    r2 = as_rows(residual, n) if residual is not None else x2
    new_residual = (torch.empty(x2.shape, dtype=torch.result_type(x, residual), device=x.device)
                    if residual is not None else out)
    if x2.shape[0]:
        block = triton.next_power_of_2(n)
        get_kernels().rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight, out, new_residual, x2.stride(0), r2.stride(0), out.stride(0), new_residual.stride(0),
            n, eps, HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=_warps(block))
    if residual is None:
        return out.view(x.shape)
    return out.view(x.shape), new_residual.view(x.shape)


def norm_rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
              head_dim: int, rotary_dim: int, norm_weights: tuple[torch.Tensor, torch.Tensor] | None,
              eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """qkv [T, (H + 2 KVH) * D] (rows may be strided) -> rotated q [T, H, D] and k
    [T, KVH, D], each head first RMS-normalised with `norm_weights` (q's, k's) if given."""
    t = qkv.shape[0]
    q = torch.empty((t, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    k = torch.empty((t, num_kv_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if t:
        qw, kw = norm_weights if norm_weights is not None else (qkv, qkv)
        cos2, sin2 = cos.reshape(t, rotary_dim), sin.reshape(t, rotary_dim)
        get_kernels().norm_rope_kernel[(t, num_heads + num_kv_heads)](
            qkv, cos2, sin2, qw, kw, q, k, qkv.stride(0), cos2.stride(0), eps,
            NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, ROT_DIM=rotary_dim,
            BLOCK_D=triton.next_power_of_2(head_dim), HAS_NORM=norm_weights is not None, num_warps=1)
    return q, k


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """activation.SiluAndMul over [T, 2I] rows."""
    n = x.shape[-1] // 2
    x2 = as_rows(x, 2 * n)
    out = torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(n))
    if x2.shape[0]:
        get_kernels().silu_and_mul_kernel[(x2.shape[0], triton.cdiv(n, block))](
            x2, out, x2.stride(0), out.stride(0), n, BLOCK=block, num_warps=_warps(block))
    return out.view(*x.shape[:-1], n)

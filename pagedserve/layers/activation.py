"""Gated activations over the fused gate|up projection output: SwiGLU, and GELU-tanh (Gemma)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.layers import fused_ops


class SiluAndMul(nn.Module):
    """[..., 2d] -> silu(x[..., :d]) * x[..., d:]; the gate half comes first."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernels = fused_ops.kernels_for(x)
        if kernels is not None:
            return kernels.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluTanhAndMul(nn.Module):
    """[..., 2d] -> gelu_tanh(x[..., :d]) * x[..., d:] (Gemma's gated MLP)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernels = fused_ops.gemma_kernels_for(x)
        if kernels is not None:
            return kernels.gelu_tanh_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

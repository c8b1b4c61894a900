"""RMSNorm, optionally fused with the residual add that precedes it in every block.

Fusing the add here (as vLLM does) keeps the decoder layer to one call per norm and
lets the residual stream be carried between layers without an extra tensor.  The
arithmetic mirrors HF's LlamaRMSNorm exactly (normalize in float32, cast back, then
scale) so that float32 outputs match HF bit for bit and bf16 ones round the same way.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.layers import fused_ops


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dimension, in float32 (both norms' first half)."""
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * rms_normalize(x, self.eps).to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without `residual`: norm(x).  With it: (norm(x + residual), x + residual)."""
        others = (self.weight,) if residual is None else (self.weight, residual)
        kernels = fused_ops.kernels_for(x, *others)
        if kernels is not None:
            return kernels.rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: scales by (1 + weight), all in float32, then casts back (HF's
    Gemma3RMSNorm order, so float32 outputs match it bit for bit).  Gemma's layers norm
    each sub-block's output before adding it to the residual stream, so the add this
    fuses comes after the norm: forward(x, residual) is residual + norm(x)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """norm(x), or with `residual`: residual + norm(x) (the norm rounded first, as two torch ops round)."""
        others = (self.weight,) if residual is None else (self.weight, residual)
        kernels = fused_ops.gemma_kernels_for(x, *others)
        if kernels is not None:
            return kernels.gemma_rms_norm(x, self.weight, self.eps, residual)
        normed = (rms_normalize(x, self.eps) * (1.0 + self.weight.float())).to(x.dtype)
        return normed if residual is None else residual + normed

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"

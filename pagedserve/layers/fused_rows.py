"""The row layout both fused kernel sets (layers/cpu_fused.py, layers/triton_fused.py)
index their inputs in.  A module of its own, below both and below layers/fused_ops.py
(which picks a set and imports it): the kernel sets never import their chooser back."""

from __future__ import annotations

import torch


def as_rows(x: torch.Tensor, width: int) -> torch.Tensor:
    """x as [rows, width] with unit column stride, as both kernel sets index columns."""
    if x.dim() == 2 and x.stride(1) == 1:  # the model's rows, as they mostly come: no reshaping
        return x
    rows = x.reshape(-1, width)
    return rows if rows.stride(-1) == 1 else rows.contiguous()

"""The LoRA product of one linear layer, batched across adapters.

A step may carry requests of several adapters and of the base model.  The runner
tells every adapted layer, through one shared `LoRABatch`, which rows (tokens) run
which adapter slot; each layer then adds, per slot, (x[rows] A^T) B^T to its output
rows, as the MoE path groups rows by expert: one dense product per adapter, in the
model's dtype, on whatever device the model runs.  B is pre-multiplied by the
adapter's scaling when the adapter is activated (lora/manager.py), and for a fused
layer (q|k|v, gate|up) the shards' A are stacked and their B placed block-diagonally,
so one adapter is two matmuls per layer whatever it targets.
"""

from __future__ import annotations

import torch

# The rows of one slot: None (every row of the step), a contiguous range, or row indices.
Rows = slice | torch.Tensor | None


class LoRABatch:
    """This step's rows per active adapter slot, set by the runner before the forward
    (slot 0, the base model, never appears: its rows get no product)."""

    def __init__(self) -> None:
        self.groups: list[tuple[int, Rows]] = []


class LinearLoRA:
    """One linear layer's resident adapters: slot -> (A [R, in], B [out, R]) in the model's
    dtype on the model's device, this rank's shard of them under tensor parallelism."""

    def __init__(self, batch: LoRABatch) -> None:
        self.batch = batch
        self.slots: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the base layer's output for x) plus each slot's product on its rows, in place."""
        if not self.slots:
            return y
        x2, y2 = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
        for slot, rows in self.batch.groups:
            weights = self.slots.get(slot)
            if weights is None:  # this adapter does not target this layer
                continue
            a, b = weights
            if rows is None:
                y2.addmm_(x2 @ a.t(), b.t())
            elif isinstance(rows, slice):
                y2[rows].addmm_(x2[rows] @ a.t(), b.t())
            else:
                y2.index_add_(0, rows, (x2.index_select(0, rows) @ a.t()) @ b.t())
        return y

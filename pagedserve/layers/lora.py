"""The LoRA product of one linear layer, batched across adapters.

A step may carry requests of several adapters and of the base model.  Every adapted
layer keeps its resident adapters packed side by side: A_all [C, in] (each slot's A
stacked) and B_all [out, C] (each slot's B, pre-scaled, next to each other), with each
column's slot.  One step then costs two matmuls per layer whatever the mix of
adapters: x A_all^T computes every slot's rank-r projection for every row, a mask
keeps, per row, only the columns of that row's slot (the base model's rows keep
none), and the product with B_all^T adds each row's own adapter.  Computing the other
slots' columns is waste, but at ranks of 8-64 and a handful of slots it is a sliver
of the base matmul, and it replaces per-adapter gathers and scatters whose dispatch
cost (hundreds of tiny ops a step) measured 3x the masked products on CPU
(docs/lora.md).  For a fused layer (q|k|v, gate|up) the shards' A are stacked and their
B placed block-diagonally when the adapter is activated (lora/manager.py).
"""

from __future__ import annotations

import torch


class LoRABatch:
    """This step's adapter slot per row (token), set by the runner before the forward;
    None when no row uses an adapter (slot 0 is the base model)."""

    def __init__(self) -> None:
        self.token_slots: torch.Tensor | None = None


class LinearLoRA:
    """One linear layer's resident adapters: slot -> (A [R, in], B [out, R]) in the model's
    dtype on the model's device (this rank's shard under tensor parallelism), and their
    packed form that `apply` uses (rebuilt by `pack` whenever the slots change)."""

    def __init__(self, batch: LoRABatch) -> None:
        self.batch = batch
        self.slots: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.packed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def pack(self) -> None:
        if not self.slots:
            self.packed = None
            return
        items = sorted(self.slots.items())
        a = torch.cat([w[0] for _, w in items])
        b = torch.cat([w[1] for _, w in items], dim=1)
        col_slot = torch.cat([torch.full((w[0].shape[0],), s, dtype=torch.long, device=a.device) for s, w in items])
        self.packed = (a, b.contiguous(), col_slot)

    def nbytes(self) -> int:
        return 0 if self.packed is None else sum(t.numel() * t.element_size() for t in self.packed[:2])

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the base layer's output for x) plus each row's adapter product, in place."""
        slots, packed = self.batch.token_slots, self.packed
        if slots is None or packed is None:
            return y
        a, b, col_slot = packed
        xa = x.reshape(-1, x.shape[-1]) @ a.t()
        xa.mul_(col_slot == slots[:, None])
        y.view(-1, y.shape[-1]).addmm_(xa, b.t())
        return y

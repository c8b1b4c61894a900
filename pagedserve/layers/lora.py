"""The LoRA product of one linear layer, batched across adapters.

A step may carry requests of several adapters and of the base model.  Every adapted
layer keeps its resident adapters packed: A_all [C, in] (each slot's A rows stacked)
and Bt_all [C, out] (each slot's B, transposed and pre-scaled), slot s owning rows
[col_start[s], col_start[s + 1]) of both.  For a fused layer (q|k|v, gate|up) the
shards' A are stacked and their B placed block-diagonally when the adapter is
activated (lora/manager.py), so one adapter is one product per layer whatever it targets.

On CPU one call of a small C++ kernel (csrc/lora.cpp) adds, to each row, the product of
its own adapter alone: per decode step it measured 3-4x faster than the dense form
below, which is what other devices run (and CPU when the kernel cannot be built): x
A_all^T for every row, masked per row to its own slot's columns (the base model's rows
keep none), times Bt_all.  Both are two products per layer for any mix of adapters, in
the model's dtype (the kernel accumulates in float).

The mask selects (zeroes the other columns) rather than multiplies: a row's product
with another adapter's A may overflow (float16) or be NaN, and inf * 0 is NaN, which
the second product would add to that row; selected away, a non-finite value stays in
the rows of the request whose adapter made it.  Bt_all is finite (lora/peft.py refuses
an adapter whose scaled weights are not), so the sum over columns adds none.
"""

from __future__ import annotations

from types import ModuleType

import torch


class LoRABatch:
    """This step's adapter slot per row (token), set by the runner before the forward;
    None when no row uses an adapter (slot 0 is the base model).  `kernel`: the CPU
    kernel (csrc/lora.cpp) when the model runs on CPU and it was built."""

    def __init__(self, kernel: ModuleType | None = None) -> None:
        self.token_slots: torch.Tensor | None = None
        self.kernel = kernel


class LinearLoRA:
    """One linear layer's resident adapters: slot -> (A [R, in], B [out, R]) in the model's
    dtype on the model's device (this rank's shard under tensor parallelism), and their
    packed form that `apply` uses (rebuilt by `pack` whenever the slots change)."""

    def __init__(self, batch: LoRABatch, num_slots: int) -> None:
        """`num_slots`: slots 0 (the base model) to num_slots - 1."""
        self.batch = batch
        self.num_slots = num_slots
        self.slots: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # (A_all, Bt_all, col_start [num_slots + 1], each column's slot) or None
        self.packed: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def pack(self) -> None:
        if not self.slots:
            self.packed = None
            return
        items = sorted(self.slots.items())
        a = torch.cat([w[0] for _, w in items]).contiguous()
        bt = torch.cat([w[1].t() for _, w in items]).contiguous()
        widths = torch.zeros(self.num_slots, dtype=torch.long)
        for s, w in items:
            widths[s] = w[0].shape[0]
        col_start = torch.cat([torch.zeros(1, dtype=torch.long), widths.cumsum(0)]).to(a.device)
        col_slot = torch.repeat_interleave(torch.arange(self.num_slots, device=a.device), widths.to(a.device))
        self.packed = (a, bt, col_start, col_slot)

    def nbytes(self) -> int:
        return 0 if self.packed is None else sum(t.numel() * t.element_size() for t in self.packed[:2])

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the base layer's output for x) plus each row's adapter product, in place."""
        slots, packed = self.batch.token_slots, self.packed
        if slots is None or packed is None:
            return y
        a, bt, col_start, col_slot = packed
        x2, y2 = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
        kernel = self.batch.kernel
        if kernel is not None and x2.dtype == a.dtype == y2.dtype and x2.device.type == "cpu":
            kernel.apply(x2.contiguous(), y2, a, bt, col_start, slots)
            return y
        xa = x2 @ a.t()
        xa.masked_fill_(col_slot != slots[:, None], 0)  # select: NaN * 0 would be NaN
        y2.addmm_(xa, bt)
        return y

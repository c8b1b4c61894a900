"""The two collectives the tensor-parallel model needs, on the default process group.

Row-parallel layers and the vocab-parallel embedding sum partial results
(`tensor_model_parallel_all_reduce`); the LM head concatenates per-rank vocabulary
slices, but only rank 0 samples, so the logits travel to rank 0 alone
(`gather_to_driver`) instead of to every rank (an all-gather would move N times
the bytes for nothing).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the ranks, in place; returns it."""
    dist.all_reduce(x)
    return x


def gather_to_driver(x: torch.Tensor, rank: int, world_size: int) -> torch.Tensor | None:
    """Rank 0: every rank's `x` concatenated along the last dim (rank order); others: None."""
    x = x.contiguous()
    if rank != 0:
        dist.gather(x, None, dst=0)
        return None
    parts = [torch.empty_like(x) for _ in range(world_size)]
    dist.gather(x, parts, dst=0)
    return torch.cat(parts, dim=-1)

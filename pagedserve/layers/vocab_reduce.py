"""The two reductions over a vocabulary-wide row that every step makes: the row's largest
logit and where it first occurs (the sampler's greedy choice and its validity check), and
the indices of the k largest (ParallelLMHead's exact top logits, the top logprobs).

Why not torch's own: on CPU `x.max(-1)` (with indices) and `x.topk(k)` walk a row on one
thread, a scalar element at a time: for Gemma 3's 262,144-token vocabulary they took
0.17 and 0.37 ms of a 9 ms single-stream step (Zen 5), `x.amax(-1)` (values only,
vectorised and threaded) 0.01 ms.  So both first take each 256-wide block's maximum
with amax, then look inside the few blocks that can hold the answer, and a short last
block's columns always: the first whole block whose maximum is theirs, or the k with the
largest maxima (an element of the top k lies in a block whose maximum is at least
that element, and at most k - 1 other blocks can have a larger one).  The results are torch's: the same maximum and first
index, and the same top-k values (which of several equal values at the k-th place is
chosen may differ).  Narrow rows and other devices keep torch's ops.  On 2 threads
(Zen 5): one row of 262,144, max 145 -> 35 us and top-8 246 -> 37 us; 32 rows of
SmolLM2's 49,152, 411 -> 100 and 599 -> 172 us; one row of 49,152, no change.
"""

from __future__ import annotations

import torch

BLOCK = 256  # (128-1024 measured; 256 best over both vocabularies and 1-32 rows)
MIN_WIDTH = 16 * BLOCK  # narrower rows: torch's ops directly


def _wide_cpu_rows(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dim() == 2 and x.shape[1] >= MIN_WIDTH and x.stride(1) == 1


def _whole_block_maxima(x: torch.Tensor) -> torch.Tensor:
    """[N, V // BLOCK]: each whole block's maximum (NaN where a block holds one)."""
    return x[:, : x.shape[1] // BLOCK * BLOCK].unflatten(1, (-1, BLOCK)).amax(-1)


def _candidate_columns(x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """[N, len(blocks) * BLOCK + the tail]: the columns of each row's given whole blocks,
    then those of the short block at the row's end, if any (always a candidate: no
    padding to mask, and no column twice)."""
    n, width = x.shape
    columns = (blocks.unsqueeze(-1) * BLOCK + torch.arange(BLOCK, device=x.device)).flatten(1)
    whole = width // BLOCK * BLOCK
    if whole < width:
        columns = torch.cat([columns, torch.arange(whole, width, device=x.device).expand(n, -1)], dim=1)
    return columns


def row_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x.max(-1)` of [N, V] rows: each row's maximum and the first index holding it (NaN
    in a row: NaN, and an index that means nothing)."""
    if not _wide_cpu_rows(x):
        values, indices = x.max(-1)
        return values, indices
    first = _whole_block_maxima(x).max(-1).indices  # the first whole block holding their maximum
    columns = _candidate_columns(x, first.unsqueeze(-1))  # (in column order: the first index wins)
    best, at = x.gather(1, columns).max(-1)
    return best, columns.gather(1, at.unsqueeze(-1)).squeeze(1)


def row_topk_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """[N, k] distinct indices of each row's k largest values (as `x.topk(k).indices`, in
    no particular order; NaN counts as largest, as in topk)."""
    k = min(k, x.shape[1])
    if not _wide_cpu_rows(x):
        return x.topk(k, dim=-1).indices
    maxima = _whole_block_maxima(x)
    columns = _candidate_columns(x, maxima.topk(min(k, maxima.shape[1]), dim=-1).indices)
    return columns.gather(1, x.gather(1, columns).topk(k, dim=-1).indices)

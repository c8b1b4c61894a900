"""The two reductions over a vocabulary-wide row that every step makes: the row's largest
logit and where it first occurs (the sampler's greedy choice and its validity check), and
the indices of the k largest (ParallelLMHead's exact top logits, the top logprobs).

Why not torch's own: on CPU `x.max(-1)` (with indices) and `x.topk(k)` walk a row on one
thread, a scalar element at a time: for Gemma 3's 262,144-token vocabulary they took
0.17 and 0.37 ms of a 9 ms single-stream step (Zen 5), `x.amax(-1)` (values only,
vectorised and threaded) 0.01 ms.  So both first take each 256-wide block's maximum
with amax, then look inside the few blocks that can hold the answer: the first block
whose maximum is the row's, or the k whole blocks with the largest maxima and a short
last block's columns (an element of the top k lies in a block whose maximum is at least
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


def _block_maxima(x: torch.Tensor) -> torch.Tensor:
    """[N, ceil(V / BLOCK)]: each block's maximum (NaN where a block holds one); the last
    block may be shorter."""
    whole = x.shape[1] // BLOCK * BLOCK
    maxima = x[:, :whole].unflatten(1, (-1, BLOCK)).amax(-1)
    if whole < x.shape[1]:
        maxima = torch.cat([maxima, x[:, whole:].amax(-1, keepdim=True)], dim=1)
    return maxima


def _gather_blocks(x: torch.Tensor, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, column indices) [N, len(blocks) * BLOCK] of the given blocks of each row;
    the columns past the row's end (in a short last block) hold -inf at the last column."""
    columns = (blocks.unsqueeze(-1) * BLOCK + torch.arange(BLOCK, device=x.device)).flatten(1)
    past = columns >= x.shape[1]
    columns = columns.clamp_(max=x.shape[1] - 1)
    return x.gather(1, columns).masked_fill_(past, float("-inf")), columns


def row_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x.max(-1)` of [N, V] rows: each row's maximum and the first index holding it (NaN
    in a row: NaN, and an index that means nothing)."""
    if not _wide_cpu_rows(x):
        values, indices = x.max(-1)
        return values, indices
    best, block = _block_maxima(x).max(-1)  # the first block holding the row's maximum
    values, columns = _gather_blocks(x, block.unsqueeze(-1))  # (a short block's padding comes after it)
    return best, columns.gather(1, values.max(-1).indices.unsqueeze(-1)).squeeze(1)


def row_topk_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """[N, k] distinct indices of each row's k largest values (as `x.topk(k).indices`, in
    no particular order; NaN counts as largest, as in topk)."""
    k = min(k, x.shape[1])
    if not _wide_cpu_rows(x):
        return x.topk(k, dim=-1).indices
    n, width = x.shape
    whole = width // BLOCK * BLOCK
    maxima = x[:, :whole].unflatten(1, (-1, BLOCK)).amax(-1)
    blocks = maxima.topk(min(k, maxima.shape[1]), dim=-1).indices
    # The k whole blocks with the largest maxima, and a short last block's columns always:
    # every column once, so no index can come back twice.
    columns = (blocks.unsqueeze(-1) * BLOCK + torch.arange(BLOCK, device=x.device)).flatten(1)
    if whole < width:
        columns = torch.cat([columns, torch.arange(whole, width, device=x.device).expand(n, -1)], dim=1)
    return columns.gather(1, x.gather(1, columns).topk(k, dim=-1).indices)

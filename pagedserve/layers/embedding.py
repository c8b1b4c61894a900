"""Token embedding and LM head, split by vocabulary rows so tensor parallelism can shard them.

With tied embeddings the LM head does not own a weight: it reads the embedding's
Parameter, so a checkpoint that carries only `embed_tokens` (or both, identical)
loads once and the two can never drift apart.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.distributed.communication import gather_to_driver, tensor_model_parallel_all_reduce
from pagedserve.layers.linear import PackedLinear, get_tp_rank_size
from pagedserve.utils import cdiv


class VocabParallelEmbedding(nn.Module):
    """Rank r holds vocabulary rows [r * rows, (r + 1) * rows) with rows = ceil(vocab / tp);
    the last rank's tail past the vocabulary is zero padding, so any vocab size shards."""

    def __init__(self, num_embeddings: int, embedding_dim: int, shared_weight: nn.Parameter | None = None) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank_size()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.rows = cdiv(num_embeddings, self.tp_size)
        self.row_start = self.tp_rank * self.rows
        self.valid_rows = max(0, min(self.rows, num_embeddings - self.row_start))  # < rows only on the last rank
        self._linear = PackedLinear()  # used by the LM head (its own, or the tied embedding's)
        if shared_weight is not None:
            self.weight = shared_weight
            return
        self.weight = nn.Parameter(torch.empty(self.rows, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        if shard_id is not None:
            raise ValueError(f"embedding has no shard {shard_id!r}")
        if tuple(loaded_weight.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(
                f"shape mismatch for embedding: model expects {(self.num_embeddings, self.embedding_dim)}, "
                f"checkpoint has {tuple(loaded_weight.shape)}"
            )
        if self.valid_rows:
            param.data[: self.valid_rows].copy_(loaded_weight.narrow(0, self.row_start, self.valid_rows))
        param.data[self.valid_rows:].zero_()
        self._linear.invalidate()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.row_start
        mine = (local >= 0) & (local < self.valid_rows)
        y = F.embedding(local.clamp(0, self.rows - 1), self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return tensor_model_parallel_all_reduce(y)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


EXACT_TOP = 8  # 16-bit logits recomputed in float32 per row (see ParallelLMHead._exact_top)


class ParallelLMHead(VocabParallelEmbedding):
    """hidden -> float32 logits over the full vocabulary."""

    def __init__(self, num_embeddings: int, embedding_dim: int,
                 tied_to: VocabParallelEmbedding | None = None) -> None:
        super().__init__(num_embeddings, embedding_dim, tied_to.weight if tied_to is not None else None)
        if tied_to is not None:  # one packed copy, dropped when the embedding loads
            self._linear = tied_to._linear

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Rank 0 gets the full [N, vocab] logits; other tensor-parallel ranks send
        their slice to it and get None (only rank 0 samples)."""
        logits = self._linear(hidden, self.weight, None)
        if self.tp_size > 1:
            logits = gather_to_driver(logits, self.tp_rank, self.tp_size)
            if logits is None:
                return None
            return logits[:, : self.num_embeddings].float()
        logits = logits.float()
        if hidden.dtype in (torch.bfloat16, torch.float16) and logits.shape[0]:
            self._exact_top(hidden, logits)
        return logits

    def _exact_top(self, hidden: torch.Tensor, logits: torch.Tensor) -> None:
        """Recompute each row's EXACT_TOP largest logits in float32, in place.

        A 16-bit matmul rounds its output to 16 bits: logits near 25 are multiples of
        0.125 in bf16, so the top two tokens often come out equal and argmax picks the
        lower id whatever the exact values say (SmolLM2 answering "What is the capital
        of France?" in bf16: 'L' and 'The' both 25.125, exactly 25.139 and 25.178).
        The same inputs dotted in float32 for the few tokens that can win settle greedy
        choices and the top logprobs; the rest of the row keeps the fast 16-bit values.
        Costs ~0.7 ms for 32 rows of SmolLM2's 49,152-token vocabulary."""
        n = logits.shape[0]
        top = logits.topk(min(EXACT_TOP, logits.shape[1]), dim=-1).indices  # [N, k]
        w = self.weight.index_select(0, top.reshape(-1)).view(n, top.shape[1], -1).float()
        exact = torch.bmm(w, hidden.float().unsqueeze(-1)).squeeze(-1)
        logits.scatter_(1, top, exact)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:  # type: ignore[override]
        return self.compute_logits(hidden)

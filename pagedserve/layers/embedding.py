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


class VocabParallelEmbedding(nn.Module):
    """Rank r holds vocabulary rows [r * rows, (r + 1) * rows) with rows = ceil(vocab / tp);
    the last rank's tail past the vocabulary is zero padding, so any vocab size shards."""

    def __init__(self, num_embeddings: int, embedding_dim: int, shared_weight: nn.Parameter | None = None) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank_size()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.rows = -(-num_embeddings // self.tp_size)
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
            logits = logits[:, : self.num_embeddings]
        return logits.float()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:  # type: ignore[override]
        return self.compute_logits(hidden)

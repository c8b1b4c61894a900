"""Pooling: one vector or score per prompt from the hidden states the runner computes.

A pooling request's prompt may be computed in several chunks (chunked prefill), after
a prefix-cache hit (LAST pooling only: the last token is always recomputed), or again
from the start after a preemption.  `Pooler.fold` takes each chunk's states as they
come and keeps, per request, only what its pooling type needs: nothing for LAST, the
running float32 sum for MEAN, the first state for CLS, plus how many prompt positions
are folded in, so that positions recomputed after a preemption are not counted twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from pagedserve.pooling_params import PoolingParams


class LogitsModel(Protocol):
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits of the rows (None on tensor-parallel ranks > 0, which join the gather)."""
        ...


@dataclass
class _Partial:
    covered: int = 0  # prompt positions folded in so far
    acc: torch.Tensor | None = None  # MEAN: the sum of their states; CLS: the first state


class Pooler:
    def __init__(self) -> None:
        self._partial: dict[str, _Partial] = {}

    def fold(self, req_id: str, params: PoolingParams, states: torch.Tensor, start: int,
             num_prompt: int) -> torch.Tensor | None:
        """`states`: the final hidden states of prompt positions [start, start + rows),
        computed this step.  Returns the pooled float32 state once this chunk ends the
        prompt, else None."""
        end = start + states.shape[0]
        kind = params.pooling_type if params.task == "embed" else "LAST"
        if kind == "LAST":
            return states[-1].float() if end >= num_prompt else None
        part = self._partial.setdefault(req_id, _Partial())
        if start > part.covered:
            raise RuntimeError(f"request {req_id!r}: prompt positions {part.covered}..{start - 1} were never "
                               f"computed, but {kind} pooling needs every one")
        if end > part.covered:
            new = states[part.covered - start:]
            if kind == "MEAN":
                total = new.float().sum(0)
                part.acc = total if part.acc is None else part.acc + total
            elif part.covered == 0:  # CLS
                part.acc = states[0].float()
            part.covered = end
        if end < num_prompt:
            return None
        del self._partial[req_id]
        assert part.acc is not None
        return part.acc / num_prompt if kind == "MEAN" else part.acc

    def forget(self, req_id: str) -> None:
        """The request finished or was aborted: drop what was folded of it."""
        self._partial.pop(req_id, None)

    @property
    def num_partial(self) -> int:
        return len(self._partial)


def pooled_outputs(model: LogitsModel, pooled: dict[str, tuple[PoolingParams, torch.Tensor]]
                   ) -> dict[str, torch.Tensor]:
    """Each finished request's result on the host: an embedding (cut to `dimensions`,
    L2-normalised when asked) or, for task "classify", a one-element tensor holding
    sigmoid(logit(positive) - logit(negative)) of its last state.  Every tensor-parallel
    rank calls this (the classifier's logits are a collective); ranks > 0 get {}."""
    out: dict[str, torch.Tensor] = {}
    scored = [(rid, p, s) for rid, (p, s) in pooled.items() if p.task == "classify"]
    if scored:
        logits = model.compute_logits(torch.stack([s for _, _, s in scored]))
        if logits is None:
            return {}
        for row, (rid, p, _) in enumerate(scored):
            assert p.classifier_token_ids is not None
            neg, pos = p.classifier_token_ids
            diff = logits[row, pos].float() - logits[row, neg].float()
            out[rid] = (diff if p.use_activation is False else torch.sigmoid(diff)).reshape(1).cpu()
    for rid, (p, state) in pooled.items():
        if p.task == "embed":
            v = state[: p.dimensions] if p.dimensions else state
            out[rid] = (F.normalize(v, dim=-1) if p.normalize else v).cpu()
    return out

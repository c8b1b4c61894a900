"""Pooler.fold: any way a prompt's positions arrive (one chunk, many, recomputed after a
preemption) pools to what the whole prompt's states give at once."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from pagedserve.layers.pooler import Pooler, pooled_outputs
from pagedserve.pooling_params import PoolingParams


def _whole(states: torch.Tensor, kind: str) -> torch.Tensor:
    return {"LAST": states[-1], "MEAN": states.mean(0), "CLS": states[0]}[kind]


def _fold(pooler: Pooler, params: PoolingParams, states: torch.Tensor, cuts: list[int]) -> torch.Tensor | None:
    out, start = None, 0
    for end in [*cuts, len(states)]:
        out = pooler.fold("r", params, states[start:end], start, len(states))
        start = end
    return out


@given(n=st.integers(1, 40), data=st.data(), kind=st.sampled_from(["LAST", "MEAN", "CLS"]))
def test_chunks_pool_like_the_whole_prompt(n: int, data: st.DataObject, kind: str) -> None:
    states = torch.randn(n, 8, generator=torch.Generator().manual_seed(n))
    cuts = sorted(set(data.draw(st.lists(st.integers(1, max(n - 1, 1)), max_size=5)))) if n > 1 else []
    pooler = Pooler()
    params = PoolingParams(pooling_type=kind)
    got = _fold(pooler, params, states, cuts)
    assert got is not None and torch.allclose(got, _whole(states, kind), atol=1e-5)
    assert pooler.num_partial == 0  # nothing kept once the request has its result


@pytest.mark.parametrize("kind", ["MEAN", "CLS"])
def test_positions_recomputed_after_a_preemption_count_once(kind: str) -> None:
    states = torch.randn(10, 4)
    pooler, params = Pooler(), PoolingParams(pooling_type=kind)
    assert pooler.fold("r", params, states[:6], 0, 10) is None
    # preempted (recompute): the prompt starts again from position 0, in other chunks
    assert pooler.fold("r", params, states[:4], 0, 10) is None
    got = pooler.fold("r", params, states[4:], 4, 10)
    assert torch.allclose(got, _whole(states, kind), atol=1e-6)


def test_a_gap_in_the_positions_is_a_bug_not_a_silent_result() -> None:
    pooler = Pooler()
    with pytest.raises(RuntimeError, match="never computed"):
        pooler.fold("r", PoolingParams(pooling_type="MEAN"), torch.randn(3, 4), 5, 8)
    pooler.forget("r")
    assert pooler.num_partial == 0


class _Head:
    """compute_logits of a fixed matrix (a stand-in LM head)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.weight.T


def test_outputs_cut_normalise_and_score() -> None:
    state = torch.tensor([3.0, 4.0, 12.0])
    head = _Head(torch.eye(3))
    out = pooled_outputs(head, {
        "plain": (PoolingParams(normalize=False), state),
        "unit": (PoolingParams(normalize=True), state),
        "cut": (PoolingParams(normalize=True, dimensions=2), state),
        "score": (PoolingParams(task="classify", classifier_token_ids=(0, 2)), state),
    })
    assert torch.equal(out["plain"], state)
    assert torch.allclose(out["unit"], state / 13)
    assert torch.allclose(out["cut"], torch.tensor([0.6, 0.8]))
    assert torch.allclose(out["score"], torch.sigmoid(torch.tensor([12.0 - 3.0])))

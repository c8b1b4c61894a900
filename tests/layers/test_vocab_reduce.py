"""row_max and row_topk_indices give torch's answers: the same maximum and first index
as `max(-1)`, the same top-k values as `topk`, over any width (a short last block, rows
narrower than the blocked path), ties, -inf, NaN and strided rows."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.layers import vocab_reduce
from pagedserve.layers.vocab_reduce import row_max, row_topk_indices


def rows(seed: int, n: int, width: int, levels: int, specials: int) -> torch.Tensor:
    """[n, width] with values from `levels` distinct ones (few: many ties), and `specials`
    entries set to -inf or NaN at random places."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, levels, (n, width), generator=g).float() / 4 - 3
    for _ in range(specials):
        r, c = torch.randint(0, n, (1,), generator=g).item(), torch.randint(0, width, (1,), generator=g).item()
        x[r, c] = float("nan") if torch.rand(1, generator=g).item() < 0.3 else float("-inf")
    return x


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), n=st.integers(1, 5),
       width=st.sampled_from([7, 4095, 4096, 4097, 5000, 8192 + 255, 49152]),
       levels=st.sampled_from([2, 50, 100000]), specials=st.integers(0, 3), k=st.integers(1, 9),
       strided=st.booleans())
def test_the_same_answers_as_torch(seed, n, width, levels, specials, k, strided):
    x = rows(seed, n, width + 64 * strided, levels, specials)
    if strided:  # a view of the first columns, as the LM head's unpadded logits are
        x = x[:, :width]
    best, first = row_max(x)
    want_best, want_first = x.max(-1)
    assert torch.equal(best.isnan(), want_best.isnan())
    ok = ~want_best.isnan()
    assert torch.equal(best[ok], want_best[ok]) and torch.equal(first[ok], want_first[ok])
    top = row_topk_indices(x, k)
    kk = min(k, width)
    assert top.shape == (n, kk) and all(len(set(r)) == kk for r in top.tolist())
    values = x.gather(1, top).nan_to_num(nan=float("inf")).sort(-1).values
    want = x.topk(kk, dim=-1).values.nan_to_num(nan=float("inf")).sort(-1).values
    assert torch.equal(values, want)


def test_wide_rows_take_the_blocked_path(monkeypatch):
    """(Otherwise the test above would check torch against itself.)"""
    calls = []
    blocked = vocab_reduce._block_maxima
    monkeypatch.setattr(vocab_reduce, "_block_maxima", lambda x: calls.append(x.shape) or blocked(x))
    x = torch.randn(2, vocab_reduce.MIN_WIDTH + 5)
    row_max(x)
    row_topk_indices(x, 8)
    row_max(x[:, :100])
    assert calls == [x.shape, x.shape]

"""row_max and row_topk_indices give torch's answers: the same maximum and first index
as `max(-1)`, the same top-k values as `topk`, over any width (a short last chunk, rows
narrower than one), ties, -inf, NaN and strided rows."""

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
       width=st.sampled_from([1, 7, 63, 64, 65, 4097, 5000, 8192 + 255, 49152]),
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


def test_rows_of_mostly_minus_infinity_give_distinct_indices():
    """Fewer finite values than k, anywhere in the row (the first k columns, a partial
    last chunk): still k distinct indices, the finite ones among them."""
    for width in (9, 64 + 7, 4097, 4096 + 255, 8192):
        x = torch.full((2, width), float("-inf"))
        x[0, -1] = 1.0
        ids = [3, min(700, width - 3), width - 2]
        x[1, ids] = torch.tensor([2.0, 5.0, 1.0])
        top = row_topk_indices(x, 8)
        assert all(len(set(r)) == 8 for r in top.tolist())
        assert width - 1 in top[0].tolist() and set(ids) <= set(top[1].tolist())
        best, first = row_max(x)
        assert best.tolist() == [1.0, 5.0] and first.tolist() == [width - 1, ids[1]]


def test_float32_cpu_rows_take_the_kernel(monkeypatch):
    """(Otherwise the tests above would check torch against itself.)  Other dtypes keep
    torch's ops, and so does every row where the kernels do not build."""
    kernel = vocab_reduce._kernel()
    assert kernel is not None
    calls = []
    monkeypatch.setattr(vocab_reduce, "_kernel", lambda: calls.append(1) or kernel)
    x = torch.randn(2, 300)
    row_max(x)
    row_topk_indices(x[:, :100], 8)
    row_max(x.double())
    assert len(calls) == 2
    monkeypatch.setattr(vocab_reduce, "_kernel", lambda: None)
    assert torch.equal(row_max(x)[1], x.max(-1).indices)
    assert torch.equal(row_topk_indices(x, 3).sort(-1).values, x.topk(3).indices.sort(-1).values)


def test_k_past_the_kernels_takes_torch():
    x = torch.randn(3, 5000)
    k = vocab_reduce._kernel().MAX_TOPK + 1
    assert torch.equal(row_topk_indices(x, k), x.topk(k).indices)

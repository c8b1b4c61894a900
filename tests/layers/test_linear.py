"""PackedLinear: bf16 CPU weights pre-packed for oneDNN must give F.linear's exact bits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.layers.linear import PackedLinear, ReplicatedLinear


@pytest.mark.parametrize("rows", [0, 1, 7, 33, 300])
def test_packed_matches_f_linear_bitwise(rows: int) -> None:
    torch.manual_seed(rows)
    w = torch.randn(96, 64, dtype=torch.bfloat16)
    b = torch.randn(96, dtype=torch.bfloat16)
    x = torch.randn(rows, 80, dtype=torch.bfloat16)[:, :64]  # strided rows, as from a fused projection
    lin = PackedLinear()
    with torch.no_grad():
        assert torch.equal(lin(x, w, b), F.linear(x, w, b))
        assert torch.equal(lin(x, w, None), F.linear(x, w))
    if torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        assert lin._packed is not None and PackedLinear.enabled  # the packed path really ran


def test_repacks_when_weights_are_loaded_again() -> None:
    layer = ReplicatedLinear(64, 32).to(torch.bfloat16)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        layer.weight_loader(layer.weight, torch.randn(32, 64))
        first = layer(x)
        new = torch.randn(32, 64)
        layer.weight_loader(layer.weight, new)  # writes through .data: no version bump
        assert torch.equal(layer(x), F.linear(x, new.to(torch.bfloat16)))
        assert not torch.equal(layer(x), first)
        layer.weight.mul_(2)  # an in-place write torch does count
        assert torch.equal(layer(x), F.linear(x, 2 * new.to(torch.bfloat16)))


def test_float32_and_grad_paths_are_plain_f_linear() -> None:
    w, x = torch.randn(8, 4), torch.randn(5, 4)  # (2-4 float32 rows swap the operands: below)
    lin = PackedLinear()
    with torch.no_grad():
        assert torch.equal(lin(x, w, None), F.linear(x, w)) and lin._packed is None
    wb, xb = w.bfloat16(), x.bfloat16()
    assert torch.equal(lin(xb, wb, None), F.linear(xb, wb)) and lin._packed is None  # grad mode on


def test_float32_with_2_to_4_rows_swaps_the_operands_and_keeps_the_values(monkeypatch):
    import pagedserve.layers.linear as linear_module

    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(300, 96, generator=g), torch.randn(300, generator=g)
    calls = []
    real = linear_module._swapped_float32
    monkeypatch.setattr(linear_module, "_swapped_float32", lambda *a: calls.append(a[0].shape) or real(*a))
    lin = PackedLinear()
    for shape in [(1, 96), (2, 96), (3, 96), (4, 96), (5, 96), (2, 2, 96), (1, 3, 96)]:
        x = torch.randn(*shape, generator=g)
        for bias in (None, b):
            got = lin(x, w, bias)
            assert got.shape == (*shape[:-1], 300) and got.is_contiguous()
            torch.testing.assert_close(got, torch.nn.functional.linear(x, w, bias), rtol=1e-6, atol=1e-5)
    assert sorted({s[:-1] for s in calls}) == [(1, 3), (2,), (2, 2), (3,), (4,)]
    lin(torch.randn(3, 96, dtype=torch.bfloat16), w.bfloat16(), None)  # other dtypes keep their own path
    assert len(calls) == 10

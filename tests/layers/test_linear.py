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
    w, x = torch.randn(8, 4), torch.randn(3, 4)
    lin = PackedLinear()
    with torch.no_grad():
        assert torch.equal(lin(x, w, None), F.linear(x, w)) and lin._packed is None
    wb, xb = w.bfloat16(), x.bfloat16()
    assert torch.equal(lin(xb, wb, None), F.linear(xb, wb)) and lin._packed is None  # grad mode on

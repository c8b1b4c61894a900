"""The layers' choice of fused kernels forced for a block (fused_ops.OVERRIDE), the
tolerance of one rounding step, and the dtypes, builds and inputs, for the tests that
compare the C++ kernels with the torch ops."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from pagedserve.layers import fused_ops
from tests.cpu_builds import AVX2_TEST_BUILD, avx2_param


@contextlib.contextmanager
def fused(on: bool) -> Iterator[None]:
    """True: the Triton kernels on every tensor; False: the torch ops everywhere."""
    previous, fused_ops.OVERRIDE = fused_ops.OVERRIDE, on
    try:
        yield
    finally:
        fused_ops.OVERRIDE = previous


def one_rounding(dtype: torch.dtype) -> dict:
    """One rounding step of the dtype: the kernels sum a row's squares in another order
    (and their exp differs from torch's in its last bits); float32's is a few ulp."""
    return {torch.float32: dict(atol=2e-6, rtol=2e-6), torch.float16: dict(atol=2e-3, rtol=2e-3),
            torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}[dtype]


DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# The plain AVX2 build (another vector width: other sums of squares, the same rounding).
VARIANTS = [None, avx2_param(AVX2_TEST_BUILD)]


def gated_input(rows: int, inter: int, dtype: torch.dtype, extremes: list[float]) -> torch.Tensor:
    """A gated activation's input ([gate | up], seeded by `inter`), its first six values
    `extremes` (past the kernels' exp clamps, and zeros)."""
    g = torch.Generator().manual_seed(inter)
    x = (torch.randn(rows, 2 * inter, generator=g) * 4).to(dtype)
    x[0, :6] = torch.tensor(extremes).to(dtype)
    return x

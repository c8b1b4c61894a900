"""The layers' choice of fused kernels forced for a block (fused_ops.OVERRIDE), for the
tests that compare the kernels with the torch ops."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from pagedserve.layers import fused_ops


@contextlib.contextmanager
def fused(on: bool) -> Iterator[None]:
    """True: the Triton kernels on every tensor; False: the torch ops everywhere."""
    previous, fused_ops.OVERRIDE = fused_ops.OVERRIDE, on
    try:
        yield
    finally:
        fused_ops.OVERRIDE = previous

"""Fixtures of the layer tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def fused_kernel() -> None:
    """Skips where the C++ fused kernels cannot build here (no toolchain).  Asked at the
    first test that uses them, not at import: a build during collection stalls every
    worker's collection until it is done (26 s of a cold suite, real Zen 3)."""
    from pagedserve.layers import cpu_fused

    error = cpu_fused.fused_kernel_error()
    if error is not None:
        pytest.skip(f"no C++ toolchain here: {error}")

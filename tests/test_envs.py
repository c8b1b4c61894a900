"""The environment variables read in pagedserve/envs.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pagedserve import envs


def test_the_fused_kernels_switch_reads_every_spelling_of_off(monkeypatch) -> None:
    """Only "0" was read: PAGEDSERVE_FUSED_KERNELS=off left the kernels on, unsaid."""
    for value, want in (("0", False), ("off", False), ("false", False), ("1", True), ("", None)):
        monkeypatch.setenv("PAGEDSERVE_FUSED_KERNELS", value)
        assert envs.fused_kernels() is want
    monkeypatch.setenv("PAGEDSERVE_FUSED_KERNELS", "maybe")
    with pytest.raises(ValueError, match="PAGEDSERVE_FUSED_KERNELS must be 0 or 1, got 'maybe'"):
        envs.fused_kernels()
    out = subprocess.run([sys.executable, "-c", "from pagedserve.layers import fused_ops; print(fused_ops.OVERRIDE)"],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PAGEDSERVE_FUSED_KERNELS": "off"})
    assert out.stdout.strip() == "False", out

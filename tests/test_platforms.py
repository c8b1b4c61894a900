"""The device helpers every layer shares (pagedserve/platforms.py)."""

from __future__ import annotations

import torch

from pagedserve.platforms import available_memory_bytes, is_cpu, is_cuda


def test_available_memory_is_plausible() -> None:
    free = available_memory_bytes(torch.device("cpu"))
    assert 16 * 2**20 < free < 2**50


def test_device_kinds() -> None:
    assert is_cpu("cpu") and is_cpu(torch.device("cpu")) and not is_cuda("cpu")
    assert is_cuda("cuda:1") and not is_cpu(torch.device("cuda", 0))

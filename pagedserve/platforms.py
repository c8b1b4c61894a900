"""The device kinds the engine branches on, named in one place.

Code asks `is_cpu(device)` / `is_cuda(device)` rather than comparing `device.type` with
string literals here and there: where host and accelerator differ (pinned buffers,
overlap scheduling, CUDA graphs, the CPU kernels) reads the same everywhere.
"""

from __future__ import annotations

import torch

_CPU, _CUDA = "cpu", "cuda"


def is_cpu(device: torch.device | str) -> bool:
    return (device if isinstance(device, torch.device) else torch.device(device)).type == _CPU


def is_cuda(device: torch.device | str) -> bool:
    return (device if isinstance(device, torch.device) else torch.device(device)).type == _CUDA

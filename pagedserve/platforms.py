"""The device kinds the engine branches on, named in one place.

Code asks `is_cpu(device)` / `is_cuda(device)` rather than comparing `device.type` with
string literals here and there: where host and accelerator differ (pinned buffers,
overlap scheduling, CUDA graphs, the CPU kernels) reads the same everywhere.
"""

from __future__ import annotations

import os

import torch

_CPU, _CUDA = "cpu", "cuda"


def is_cpu(device: torch.device | str) -> bool:
    return (device if isinstance(device, torch.device) else torch.device(device)).type == _CPU


def is_cuda(device: torch.device | str) -> bool:
    return (device if isinstance(device, torch.device) else torch.device(device)).type == _CUDA


def available_memory_bytes(device: torch.device) -> int:
    """Free memory on `device`, what the weights and the KV cache may draw on: MemAvailable
    on CPU, free device memory on CUDA."""
    if is_cuda(device):
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:  # not Linux: physical pages free (an underestimate of what can be reclaimed)
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        raise ValueError("cannot tell how much memory is free here; set kv_cache_memory_bytes") from None

"""Size, allocate and bind the paged KV cache: per attention layer a K and a V tensor
of [num_blocks, block_size, num_kv_heads, head_dim].

Block 0 is the null block: the core's BlockPool never hands it out, block tables pad
with it, and backends point padded reads at it, so it is zeroed here.  The rest is
left uninitialised (touching gigabytes of pages at start-up would only cost time and
resident memory): a backend must not let never-written slots reach its arithmetic.
torch_paged zeroes each block in the step that writes its first slot; torch_ref
reads only written slots.
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

from pagedserve.config import CacheConfig
from pagedserve.layers.attention import Attention
from pagedserve.platforms import is_cpu, is_cuda
from pagedserve.utils import cdiv

logger = logging.getLogger("pagedserve")

NULL_BLOCK_ID = 0


def get_attention_layers(model: nn.Module) -> list[Attention]:
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    if not layers:
        raise ValueError(f"model {type(model).__name__} has no pagedserve Attention layers")
    return layers


def bytes_per_block(layers: list[Attention], block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return sum(2 * block_size * layer.num_kv_heads * layer.head_dim * elem for layer in layers)


def available_memory_bytes(device: torch.device) -> int:
    """Free memory the cache may draw on: MemAvailable on CPU, free device memory on CUDA."""
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


def cuda_memory_info(device: torch.device) -> tuple[int, int, int]:
    """(free, total, allocated by this process's tensors) on a CUDA device.  After
    the profile run `allocated` is the weights and persistent buffers."""
    free, total = torch.cuda.mem_get_info(device)
    return int(free), int(total), int(torch.cuda.memory_allocated(device))


def gpu_kv_budget(total: int, free: int, weights: int, activations: int, utilization: float) -> int:
    """Bytes for the KV cache on a GPU (vLLM's rule): the engine may use `utilization`
    of the device's total memory; weights and peak activations come out of that first.
    Never more than is free now once activations are set aside, so memory held by
    other processes shrinks the cache instead of failing an allocation later."""
    return min(int(total * utilization) - weights - activations, free - activations)


def determine_num_blocks(
    cache_config: CacheConfig, block_bytes: int, max_model_len: int, max_num_seqs: int,
    device: torch.device, reserved_bytes: int = 0,
) -> tuple[int, str]:
    """(blocks, the null block included, for the configured budget; the rule that chose
    that number, for the start-up log).

    An explicit `kv_cache_memory_bytes` is taken as given.  Otherwise, on CPU the cache
    takes cpu_kv_cache_fraction of free memory; on CUDA gpu_kv_budget's share of
    gpu_memory_utilization x total memory, with `reserved_bytes` the profile run's peak
    activations.  Either is capped at what max_num_seqs requests of max_model_len
    tokens could ever use."""
    bs = cache_config.block_size
    blocks_per_req = cdiv(max_model_len, bs)
    need = max_num_seqs * blocks_per_req + 1
    need_text = (f"max_num_seqs={max_num_seqs} x max_model_len={max_model_len} could use "
                 f"{need * block_bytes / 2**30:.2f} GiB")
    if cache_config.num_blocks is not None:
        num_blocks = int(cache_config.num_blocks)
        source = f"num_blocks={num_blocks} (given, or agreed by the tensor-parallel ranks)"
    elif cache_config.kv_cache_memory_bytes is not None:
        budget = int(cache_config.kv_cache_memory_bytes)
        if budget <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be positive, got {budget}")
        num_blocks = budget // block_bytes
        source = f"kv_cache_memory_bytes={budget}"
    elif is_cuda(device):
        fraction = cache_config.gpu_memory_utilization
        if not 0 < fraction <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {fraction}")
        free, total, weights = cuda_memory_info(device)
        budget = gpu_kv_budget(total, free, weights, reserved_bytes, fraction)
        num_blocks = min(max(budget, 0) // block_bytes, need)
        source = (f"gpu_memory_utilization={fraction} of {total / 2**30:.1f} GiB total memory, less "
                  f"{weights / 2**30:.2f} GiB of weights and {reserved_bytes / 2**30:.2f} GiB of peak "
                  f"activations ({free / 2**30:.1f} GiB free now),")
        if num_blocks - 1 < blocks_per_req:
            raise ValueError(
                f"KV cache too small: {source} leaves {max(budget, 0) / 2**30:.2f} GiB = "
                f"{max(num_blocks - 1, 0)} usable blocks of {bs} tokens ({block_bytes} bytes each), but one "
                f"request of max_model_len={max_model_len} needs {blocks_per_req}; raise gpu_memory_utilization "
                f"or lower max_model_len (or set kv_cache_memory_bytes)"
            )
        source += f" {max(budget, 0) / 2**30:.2f} GiB for the cache"
        if num_blocks == need:
            source = f"{need_text}, less than {source}"
    else:
        fraction, name = cache_config.cpu_kv_cache_fraction, "cpu_kv_cache_fraction"
        if not 0 < fraction <= 1:
            raise ValueError(f"{name} must be in (0, 1], got {fraction}")
        free = available_memory_bytes(device)
        budget = int(free * fraction) - reserved_bytes
        num_blocks = min(max(budget, 0) // block_bytes, need)
        source = f"{name}={fraction} of {free / 2**30:.1f} GiB available memory"
        source = (f"{need_text}, less than {source}" if num_blocks == need
                  else f"{source}, less than the {need_text}")
        source += " (set kv_cache_memory_bytes to choose)"
    if num_blocks - 1 < blocks_per_req:
        raise ValueError(
            f"KV cache too small: {source} gives {max(num_blocks - 1, 0)} usable blocks of {bs} tokens "
            f"({block_bytes} bytes each), but one request of max_model_len={max_model_len} needs "
            f"{blocks_per_req}; raise kv_cache_memory_bytes or lower max_model_len"
        )
    return num_blocks, source


def allocate_kv_caches(layers: list[Attention], num_blocks: int, block_size: int, dtype: torch.dtype,
                       device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """On CPU the cache is written through at once: an untouched allocation only becomes
    resident as the block pool cycles through its blocks, so RSS would climb by the whole
    cache over hours of traffic (a leak to anyone watching it) and a machine without the
    memory would fail mid-serving instead of at start-up."""
    caches = []
    for layer in layers:
        shape = (num_blocks, block_size, layer.num_kv_heads, layer.head_dim)
        if is_cpu(device):
            k, v = (torch.zeros(shape, dtype=dtype, device=device) for _ in range(2))
        else:
            k, v = (torch.empty(shape, dtype=dtype, device=device) for _ in range(2))
            k[NULL_BLOCK_ID].zero_()
            v[NULL_BLOCK_ID].zero_()
        caches.append((k, v))
    return caches


def log_kv_cache(num_blocks: int, block_size: int, max_model_len: int, block_bytes: int, device: torch.device,
                 why: str) -> None:
    """Usable blocks (the null block left out); concurrency counts whole blocks per request."""
    usable = num_blocks - 1
    concurrency = usable / cdiv(max_model_len, block_size)
    logger.info("KV cache on %s: %.2f GiB = %d blocks of %d tokens (%d tokens; max concurrency at max_model_len: "
                "%.2f), sized by %s", device, num_blocks * block_bytes / 2**30, usable, block_size,
                usable * block_size, concurrency, why)

"""Size, allocate and bind the paged KV cache: K and V tensors of [num_blocks,
block_size, num_kv_heads, head_dim], one pair per attention layer, or, for a model
whose layers do not all attend alike, one pair per slot of its KV-cache groups
(`KVCacheLayout`).

Block 0 is the null block: the core's BlockPool never hands it out, block tables pad
with it, and backends point padded reads at it, so it is zeroed here.  The rest is
left uninitialised (touching gigabytes of pages at start-up would only cost time and
resident memory): a backend must not let never-written slots reach its arithmetic.
torch_paged zeroes each block in the step that writes its first slot; torch_ref
reads only written slots.
"""

from __future__ import annotations

import logging
import math
import mmap
from dataclasses import dataclass

import torch
from torch import nn

from pagedserve.attention import kv_dtype
from pagedserve.config import CacheConfig
from pagedserve.core.kv_cache_manager import max_blocks_held
from pagedserve.layers.attention import Attention
from pagedserve.platforms import available_memory_bytes, is_cpu, is_cuda

logger = logging.getLogger("pagedserve")

NULL_BLOCK_ID = 0


def get_attention_layers(model: nn.Module) -> list[Attention]:
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    if not layers:
        raise ValueError(f"model {type(model).__name__} has no pagedserve Attention layers")
    return layers


@dataclass(frozen=True)
class KVCacheLayout:
    """How attention layers share the cache (vLLM v1's hybrid KV cache).

    Layers are grouped by attention type (full, or a sliding window of W tokens); each
    KV-cache group gets its own blocks from the one block pool (core/kv_cache_manager.py).
    For one pool to serve every group, a block must hold as many layers in each: every
    group has `num_slots` layers (a type's last group may have fewer), and layer j of
    each group uses the j-th of `num_slots` shared K/V tensor pairs.  Gemma 3 270M (15
    sliding layers, 3 full ones) gets one full group and five sliding groups of three
    layers, so a block holds three layers' KV; a model of one attention type has one
    group holding every layer, and a tensor pair per layer, as before.
    """

    group_windows: tuple[int | None, ...]  # each group's sliding window (None: full attention)
    layer_group: tuple[int, ...]  # per attention layer, in model order
    layer_slot: tuple[int, ...]  # per attention layer: the shared tensor pair it uses
    num_slots: int  # layers a block holds (tensor pairs allocated)


def kv_cache_layout(layers: list[Attention]) -> KVCacheLayout:
    windows = [layer.sliding_window for layer in layers]
    kinds = sorted(set(windows), key=lambda w: -1 if w is None else w)  # full attention first
    if len(kinds) == 1:
        n = len(layers)
        return KVCacheLayout((kinds[0],), (0,) * n, tuple(range(n)), n)
    shapes = {(layer.num_kv_heads, layer.head_dim) for layer in layers}
    if len(shapes) > 1:
        raise ValueError(f"layers of different attention types share the KV cache's blocks, so they must have "
                         f"one KV shape; got (num_kv_heads, head_dim) {sorted(shapes)}")
    by_kind = {w: [i for i, x in enumerate(windows) if x == w] for w in kinds}
    num_slots = min(len(idx) for idx in by_kind.values())
    group_windows: list[int | None] = []
    layer_group, layer_slot = [0] * len(layers), [0] * len(layers)
    for w in kinds:
        idx = by_kind[w]
        for start in range(0, len(idx), num_slots):
            for slot, i in enumerate(idx[start:start + num_slots]):
                layer_group[i], layer_slot[i] = len(group_windows), slot
            group_windows.append(w)
    return KVCacheLayout(tuple(group_windows), tuple(layer_group), tuple(layer_slot), num_slots)


def slot_layers(layers: list[Attention], layout: KVCacheLayout) -> list[Attention]:
    """One layer per tensor slot (its shape is the slot's)."""
    firsts: dict[int, Attention] = {}
    for layer, slot in zip(layers, layout.layer_slot, strict=True):
        firsts.setdefault(slot, layer)
    return [firsts[j] for j in range(layout.num_slots)]


def bytes_per_block(layers: list[Attention], block_size: int, dtype: torch.dtype,
                    layout: KVCacheLayout | None = None) -> int:
    """Bytes of one block id: every layer's K and V, or with a layout, every slot's."""
    elem = torch.empty((), dtype=dtype).element_size()
    if layout is not None:
        layers = slot_layers(layers, layout)
    return sum(2 * block_size * layer.num_kv_heads * kv_dtype.row_width(layer.head_dim, dtype) * elem
               for layer in layers)


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
    device: torch.device, reserved_bytes: int = 0, group_windows: tuple[int | None, ...] = (None,),
    max_step_tokens: int | None = None,
) -> tuple[int, str]:
    """(blocks, the null block included, for the configured budget; the rule that chose
    that number, for the start-up log).

    An explicit `kv_cache_memory_bytes` is taken as given.  Otherwise, on CPU the cache
    takes kv_cache_memory_ceiling bytes if set, else cpu_kv_cache_space, else cpu_kv_cache_fraction of free memory;
    on CUDA gpu_kv_budget's share of gpu_memory_utilization x total memory (at most the
    ceiling), with `reserved_bytes` the profile run's peak activations.  Either is capped at what max_num_seqs requests of max_model_len
    tokens could ever use (with sliding-window groups, what they hold at most: see
    max_blocks_held)."""
    bs = cache_config.block_size
    blocks_per_req = max_blocks_held(max_model_len, bs, group_windows, max_step_tokens or max_model_len)
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
        if is_cpu(device) and budget > (free := available_memory_bytes(device)):
            # (mapped as used: it starts, then the kernel kills it under load)
            logger.warning("kv_cache_memory_bytes=%d is more than the %.1f GiB of memory available now: the cache "
                           "is mapped as it fills, so a busy server may be killed for memory", budget, free / 2**30)
    elif is_cuda(device):
        fraction = cache_config.gpu_memory_utilization
        if not 0 < fraction <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {fraction}")
        free, total, weights = cuda_memory_info(device)
        budget = gpu_kv_budget(total, free, weights, reserved_bytes, fraction)
        if cache_config.kv_cache_memory_ceiling is not None:
            budget = min(budget, cache_config.kv_cache_memory_ceiling)
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
        if cache_config.kv_cache_memory_ceiling is not None:
            budget = cache_config.kv_cache_memory_ceiling
            source = f"kv_cache_memory_ceiling={budget}"
        elif cache_config.cpu_kv_cache_space is not None:
            budget = cache_config.cpu_kv_cache_space - reserved_bytes
            source = (f"cpu_kv_cache_space={cache_config.cpu_kv_cache_space / 2**30:.2f} GiB "
                      "($PAGEDSERVE_CPU_KV_CACHE_SPACE or $VLLM_CPU_KVCACHE_SPACE)")
        else:
            fraction, name = cache_config.cpu_kv_cache_fraction, "cpu_kv_cache_fraction"
            if not 0 < fraction <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {fraction}")
            free = available_memory_bytes(device)
            budget = int(free * fraction) - reserved_bytes
            source = f"{name}={fraction} of {free / 2**30:.1f} GiB available memory"
        num_blocks = min(max(budget, 0) // block_bytes, need)
        source = (f"{need_text}, less than {source}" if num_blocks == need
                  else f"{source}, less than the {need_text}")
        source += " (set kv_cache_memory_bytes to choose)"
        if cache_config.gpu_memory_utilization != CacheConfig.gpu_memory_utilization:  # (the flag was given)
            source += f"; gpu_memory_utilization={cache_config.gpu_memory_utilization} sizes CUDA caches only"
    if num_blocks - 1 < blocks_per_req:
        raise ValueError(
            f"KV cache too small: {source} gives {max(num_blocks - 1, 0)} usable blocks of {bs} tokens "
            f"({block_bytes} bytes each), but one request of max_model_len={max_model_len} needs "
            f"{blocks_per_req}; raise kv_cache_memory_bytes or lower max_model_len"
        )
    return num_blocks, source


def allocate_kv_caches(layers: list[Attention], num_blocks: int, block_size: int, dtype: torch.dtype,
                       device: torch.device, layout: KVCacheLayout | None = None,
                       ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's (K, V) cache; with a layout, layers of one slot share a pair.

    On CPU the cache's pages are mapped on first touch (`lazy_zeros`), not written at
    start: the cache is a ceiling (what max_num_seqs x max_model_len could use, capped by
    the budget, as llama-server's -c), and a server becomes resident in what its traffic
    has used.  A 94 MB model's default `serve` held several GB from its first second when
    the cache was written through.  Resident memory then grows as the block pool cycles
    through its blocks, up to the cache's size (the log line at start-up says it)."""
    if layout is not None:
        pairs = allocate_kv_caches(slot_layers(layers, layout), num_blocks, block_size, dtype, device)
        return [pairs[slot] for slot in layout.layer_slot]
    caches = []
    for layer in layers:
        shape = (num_blocks, block_size, layer.num_kv_heads, kv_dtype.row_width(layer.head_dim, dtype))
        if is_cpu(device):
            k, v = (lazy_zeros(shape, dtype) for _ in range(2))
        else:
            k, v = (torch.empty(shape, dtype=dtype, device=device) for _ in range(2))
            k[NULL_BLOCK_ID].zero_()
            v[NULL_BLOCK_ID].zero_()
        caches.append((k, v))
    return caches


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros in an anonymous memory map: the kernel hands out zeroed pages
    as they are first touched, so untouched blocks cost no resident memory (a heap
    allocation would be written through: worker/cpu_malloc.py keeps large ones on the
    heap, where calloc must clear what it reuses)."""
    nbytes = math.prod(shape) * dtype.itemsize
    buffer = mmap.mmap(-1, max(nbytes, 1))  # the tensor keeps the map alive
    return torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)


def log_kv_cache(num_blocks: int, block_size: int, max_model_len: int, block_bytes: int, device: torch.device,
                 why: str, layout: KVCacheLayout | None = None, max_step_tokens: int | None = None,
                 dtype: torch.dtype | None = None) -> None:
    """Usable blocks (the null block left out); concurrency counts whole blocks per request."""
    usable = num_blocks - 1
    windows = layout.group_windows if layout is not None else (None,)
    concurrency = usable / max_blocks_held(max_model_len, block_size, windows, max_step_tokens or max_model_len)
    groups = ""
    if len(windows) > 1 or windows[0] is not None:
        kinds = ", ".join(f"{windows.count(w)} {'full-attention' if w is None else f'sliding-window ({w})'}"
                          for w in dict.fromkeys(windows))
        groups = f"; KV-cache groups of {layout.num_slots} layers: {kinds}"
    stored = f", {str(dtype).removeprefix('torch.')}, {block_bytes // block_size} bytes per token" if dtype else ""
    logger.info("KV cache on %s: %.2f GiB = %d blocks of %d tokens (%d tokens%s; max concurrency at max_model_len: "
                "%.2f%s), sized by %s", device, num_blocks * block_bytes / 2**30, usable, block_size,
                usable * block_size, stored, concurrency, groups, why)

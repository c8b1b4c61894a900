"""KV-cache storage dtypes (CacheConfig.cache_dtype, vLLM's --kv-cache-dtype).

The cache may store K/V narrower than the model computes: bfloat16 or float16 under a
float32 model (half the bytes), fp8 e4m3 or e5m2 under any (a quarter of float32's,
half of bf16's).  Values are converted when stored and read back into the compute
dtype by every attention path (the C++ decode kernel converts in registers), with a
per-tensor scale of 1, as vLLM uses fp8 without calibrated scales: e4m3 keeps values
up to 448 (larger ones saturate there), e5m2 up to 57,344 with one bit less precision.

torch on CPU has no index_copy_/index_select/index_fill_ for the float8 dtypes, so
data movement (stores, gathers, zeroing, the KV tier's copies) goes through the cache's
bytes (`raw`), and only the conversions see the float8 dtype.
"""

from __future__ import annotations

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_STORAGE = {"bfloat16": torch.bfloat16, "float16": torch.float16, "fp8_e4m3": torch.float8_e4m3fn,
            "fp8_e5m2": torch.float8_e5m2}
_E5M2_MAX = float(torch.finfo(torch.float8_e5m2).max)  # beyond it the cast gives inf (e4m3fn's saturates)


def kv_cache_torch_dtype(cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype of the cache tensors: "auto" is the model's own."""
    if cache_dtype == "auto":
        return model_dtype
    return _STORAGE[cache_dtype]


def raw(cache: torch.Tensor) -> torch.Tensor:
    """The cache as something torch can move on every device: its bytes for float8."""
    return cache.view(torch.uint8) if cache.dtype in FP8_DTYPES else cache


def to_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` converted for storage in a cache of `dtype` (e5m2 clamped to its finite range)."""
    if x.dtype == dtype:
        return x
    if dtype == torch.float8_e5m2:
        x = x.clamp(-_E5M2_MAX, _E5M2_MAX)
    return x.to(dtype)


def store(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
          slot_mapping: torch.Tensor) -> None:
    """Write each new token's K/V at its flat slot (block_id * block_size + offset)."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    for x, cache in ((key, k_cache), (value, v_cache)):
        raw(cache).view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, raw(to_cache(x, cache.dtype)))


def gather(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """The cache's rows `blocks` (whole blocks), in the cache's dtype."""
    return raw(cache).index_select(0, blocks).view(cache.dtype)


def zero_blocks(cache: torch.Tensor, blocks: torch.Tensor) -> None:
    raw(cache).index_fill_(0, blocks, 0)

"""KV-cache storage dtypes (CacheConfig.cache_dtype, vLLM's --kv-cache-dtype).

The cache may store K/V narrower than the model computes, converted when stored and
read back into the compute dtype by every attention path (the C++ decode kernel
converts in registers):
  * bfloat16 or float16 under a float32 model: half the bytes.
  * fp8 e4m3 or e5m2 (vLLM's names; a per-tensor scale of 1, as vLLM uses fp8 without
    calibrated scales): a quarter of float32's bytes; e4m3 keeps values up to 448
    (larger ones saturate there) with 3 mantissa bits, e5m2 up to 57,344 with 2.
  * int8 (llama.cpp's q8_0 idea, per token and head): each head's row of D values is
    stored as D int8 values and its float16 scale (absmax / 127) after them, so a row
    is D + 2 bytes: 3.9x fewer than float32 at D = 64, and within half a step of 1/127
    of the row's largest value, where fp8 is within 1/16 of each value.
Rows of int8 carry their scale inline, so a block is still one contiguous chunk of one
tensor, and everything that moves blocks (the KV tier, swapping, radix copies) moves
int8 blocks unchanged.

torch on CPU has no index_copy_/index_select/index_fill_ for the float8 dtypes, so
data movement (stores, gathers, zeroing, the KV tier's copies) goes through the cache's
bytes (`raw`), and only the conversions see the float8 dtype.
"""

from __future__ import annotations

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
INT8_SCALE_BYTES = 2  # a float16 scale after each int8 row
_STORAGE = {"bfloat16": torch.bfloat16, "float16": torch.float16, "fp8_e4m3": torch.float8_e4m3fn,
            "fp8_e5m2": torch.float8_e5m2, "int8": torch.int8}
# Where a cast past the dtype's range gives inf, values are clamped to it first (e4m3fn's
# cast saturates by itself, and bfloat16 has float32's range).
_CLAMPED = {t: float(torch.finfo(t).max) for t in (torch.float16, torch.float8_e5m2)}


def kv_cache_torch_dtype(cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype of the cache tensors: "auto" is the model's own."""
    if cache_dtype == "auto":
        return model_dtype
    return _STORAGE[cache_dtype]


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one head's row in a cache of `dtype` (int8 rows end in their scale)."""
    return head_dim + INT8_SCALE_BYTES if dtype == torch.int8 else head_dim


def raw(cache: torch.Tensor) -> torch.Tensor:
    """The cache as something torch can move on every device: its bytes for float8."""
    return cache.view(torch.uint8) if cache.dtype in FP8_DTYPES else cache


def to_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `x` [..., D] as a cache of `dtype` stores them: converted within the dtype's
    finite range, or for int8 quantized to [..., D + 2] (values, then the scale)."""
    if x.dtype == dtype:
        return x
    if dtype == torch.int8:
        scale = (x.float().abs().amax(-1, keepdim=True) / 127).clamp(max=_CLAMPED[torch.float16]).to(torch.float16)
        divisor = scale.float()
        q = (x.float() / torch.where(divisor == 0, 1.0, divisor)).round().clamp(-127, 127)  # (0: a row of zeros)
        return torch.cat([q.to(torch.int8), scale.view(torch.int8)], dim=-1)
    limit = _CLAMPED.get(dtype)
    if limit is not None and (not x.dtype.is_floating_point or float(torch.finfo(x.dtype).max) > limit):
        # (by range, not size: bfloat16 rows over a float16 cache too, clamped in float32,
        # where the limit is exact: float16's 65504 is 65536 in bfloat16, inf again)
        x = (x if x.dtype == torch.float32 else x.float()).clamp(-limit, limit)
    return x.to(dtype)


def from_cache(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Stored rows (as gathered from a cache) back as values of `dtype` [..., D]."""
    if rows.dtype == torch.int8:
        values, scale = rows[..., :-INT8_SCALE_BYTES], rows[..., -INT8_SCALE_BYTES:].clone().view(torch.float16)
        return (values.float() * scale.float()).to(dtype)
    return rows.to(dtype)


def store(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
          slot_mapping: torch.Tensor) -> None:
    """Write each new token's K/V at its flat slot (block_id * block_size + offset)."""
    num_kv_heads, width = k_cache.shape[-2:]
    for x, cache in ((key, k_cache), (value, v_cache)):
        raw(cache).view(-1, num_kv_heads, width).index_copy_(0, slot_mapping, raw(to_cache(x, cache.dtype)))


def gather(cache: torch.Tensor, blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The values of the cache's blocks `blocks`, [n, block_size, Hkv, D] in `dtype`."""
    return from_cache(raw(cache).index_select(0, blocks).view(cache.dtype), dtype)


def zero_blocks(cache: torch.Tensor, blocks: torch.Tensor) -> None:
    raw(cache).index_fill_(0, blocks, 0)

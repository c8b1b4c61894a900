"""Rotary position embedding (neox / HF "rotate_half" layout) with a precomputed cos/sin table.

The table covers every position the model accepts and is built once in float32, then
stored in the model dtype: that is exactly the rounding HF applies per forward, so
outputs match while a step costs one gather instead of recomputing trigonometry.
Supported `rope_scaling` types: default, linear, llama3, yarn (Qwen2.5/Qwen3's long
context) and longrope (Phi-3 / Phi-4-mini); others are refused by name rather than
silently ignored.  YaRN and LongRoPE also scale cos and sin by an attention factor,
folded into the table.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from pagedserve.layers import fused_ops
from pagedserve.layers.layernorm import RMSNorm

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def rope_params(hf_config: Any) -> dict:
    """The config's rope parameters (transformers 4.x's rope_scaling or 5.x's
    rope_parameters) with their 'rope_type' named, unchecked."""
    params = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def rope_config(hf_config: Any) -> tuple[float, dict]:
    """(rope_theta, scaling dict with a 'rope_type' key) from a transformers 4.x or 5.x config."""
    params = rope_params(hf_config)
    theta = float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))
    if params["rope_type"] not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope_scaling type {params['rope_type']!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if params["rope_type"] in ("yarn", "longrope"):
        # The context the model was trained on, and (when the config gives none) the
        # stretch factor that takes it to max_position_embeddings, as HF reads them.
        kind = params["rope_type"]
        max_pos = getattr(hf_config, "max_position_embeddings", None)
        original = (params.get("original_max_position_embeddings")
                    or getattr(hf_config, "original_max_position_embeddings", None) or max_pos)
        if original is None:
            raise ValueError(f"rope_scaling type {kind!r} needs original_max_position_embeddings")
        params["original_max_position_embeddings"] = original
        if params.get("factor") is None:
            if max_pos is None:
                raise ValueError(f"rope_scaling type {kind!r} needs factor (or max_position_embeddings)")
            params["factor"] = max_pos / original
        if kind == "longrope" and not (params.get("short_factor") and params.get("long_factor")):
            raise ValueError("rope_scaling type 'longrope' needs short_factor and long_factor")
    return theta, params


def long_rope_original(hf_config: Any) -> int | None:
    """A LongRoPE model's original context (Phi-3's 4,096), else None.  A prompt longer
    than it rotates every position with the long factors (rotates_long), as HF's forward
    over a sequence that long does; a shorter one rotates its positions below it with the
    short factors, and any past it (an answer that outgrows the context) with the long."""
    if rope_params(hf_config)["rope_type"] != "longrope":
        return None
    return int(rope_config(hf_config)[1]["original_max_position_embeddings"])


def rotates_long(num_prompt_tokens: int, original: int) -> bool:
    """Whether a request rotates all its positions with LongRoPE's long factors, decided
    once, by the engine (Request.long_rope: its KV blocks are keyed apart, and the model
    runner picks its table rows by it)."""
    return num_prompt_tokens > original


def long_prompt_rows(model: nn.Module) -> tuple[int, int] | None:
    """The model's RotaryEmbedding.long_prompt_rows (every layer shares one table's)."""
    rows = {m.long_prompt_rows for m in model.modules() if isinstance(m, RotaryEmbedding)} - {None}
    if len(rows) > 1:
        raise ValueError(f"rotary tables disagree on LongRoPE's rows: {sorted(rows)}")
    return next(iter(rows), None)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def attention_factor(scaling: dict) -> float:
    """What cos and sin are multiplied by: 1, except for YaRN (the paper's 0.1 ln(s) + 1,
    or the ratio of the two mscales DeepSeek-style configs give, or the config's own) and
    LongRoPE (sqrt(1 + ln(s) / ln(original context)), or the config's own)."""
    if scaling["rope_type"] not in ("yarn", "longrope"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "longrope":
        original = float(scaling["original_max_position_embeddings"])
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
    return _yarn_mscale(factor)


def _yarn_inv_freq(rotary_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """YaRN: dimensions that turn many times over the original context keep their
    frequency (extrapolate), those that turn less than once are slowed by `factor`
    (interpolate), with a linear ramp between beta_fast and beta_slow rotations."""
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])

    def dim_at(rotations: float) -> float:  # the dimension that turns `rotations` times over `original`
        return rotary_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_at(scaling.get("beta_fast") or 32), dim_at(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate
    wavelength = theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim)
    return 1.0 / (factor * wavelength) * (1 - keep) + 1.0 / wavelength * keep


def longrope_inv_freq(rotary_dim: int, theta: float, factors: list[float]) -> torch.Tensor:
    """LongRoPE (Phi-3 / Phi-4-mini): each frequency divided by its own factor."""
    if len(factors) != rotary_dim // 2:
        raise ValueError(f"longrope has {len(factors)} factors for {rotary_dim // 2} rotary frequencies")
    shape = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta**shape)


def inv_freq(rotary_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """The rotary frequencies; for LongRoPE the short-context ones (see RotaryEmbedding)."""
    rope_type = scaling["rope_type"]
    if rope_type == "longrope":
        return longrope_inv_freq(rotary_dim, theta, scaling["short_factor"])
    if rope_type == "yarn":
        return _yarn_inv_freq(rotary_dim, theta, scaling)
    freq = 1.0 / theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim)
    if rope_type == "linear":
        return freq / float(scaling["factor"])
    if rope_type == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band
        # between interpolated smoothly (HF's _compute_llama3_parameters).
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / freq
        scaled = torch.where(wavelen > low_wavelen, freq / factor, freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return freq


# The most positions the model being built will run (its max_model_len and drafts past
# it), set by the loader around a model's construction: a table of cos/sin per position
# costs ~0.65 KB each, and a config's max_position_embeddings of 2^23 took 5.6 GB.
_POSITIONS_LIMIT: contextvars.ContextVar[int | None] = contextvars.ContextVar("positions_limit", default=None)


@contextlib.contextmanager
def positions_limit(limit: int) -> Iterator[None]:
    """Rotary tables built in the block hold exactly `limit` positions, whatever the
    config's max_position_embeddings (which a linear or YaRN scaling's limit passes)."""
    token = _POSITIONS_LIMIT.set(limit)
    try:
        yield
    finally:
        _POSITIONS_LIMIT.reset(token)


def on_the_host_under_meta() -> contextlib.AbstractContextManager:
    """Where a model is built on the meta device (the loader sizes it there first), the
    block's arithmetic on constants (rotary frequencies) runs on the CPU; the caller moves
    the result to the default device, so only its shape is kept.  A meta tensor's
    arithmetic runs torch's Python references, whose first call imports torch._dynamo:
    1.2 s of every `generate` and `serve` start (Zen 4)."""
    return torch.device("cpu") if torch.get_default_device().type == "meta" else contextlib.nullcontext()


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, rotary_dim: int, max_position: int, theta: float,
                 scaling: dict | None = None, freq_factors: list[float] | None = None) -> None:
        """`freq_factors`: one divisor per rotary frequency, as Llama 3.1 GGUF files carry
        their scaling (llama.cpp's rope_freqs); not together with a scaling type."""
        super().__init__()
        limit = _POSITIONS_LIMIT.get()
        max_position = max_position if limit is None else limit  # (past max_position_embeddings under rope scaling)
        if rotary_dim % 2 or rotary_dim > head_dim:
            raise ValueError(f"rotary_dim {rotary_dim} must be even and <= head_dim {head_dim}")
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.max_position = max_position
        scaling = scaling or {"rope_type": "default"}
        with on_the_host_under_meta():
            cache = self._table(rotary_dim, max_position, theta, scaling, freq_factors)
        self.register_buffer("cos_sin_cache", cache.to(torch.get_default_device(), torch.get_default_dtype()),
                             persistent=False)

    def _table(self, rotary_dim: int, max_position: int, theta: float, scaling: dict,
               freq_factors: list[float] | None) -> torch.Tensor:
        """[positions, rotary_dim]: cos then sin of each position's angles (see __init__)."""
        freq = inv_freq(rotary_dim, theta, scaling)
        if freq_factors is not None:
            if scaling["rope_type"] != "default":
                raise ValueError(f"rope frequency factors and rope_scaling {scaling['rope_type']!r} both rescale "
                                 "the rotary frequencies; a model has one or the other")
            if len(freq_factors) != rotary_dim // 2:
                raise ValueError(f"{len(freq_factors)} rope frequency factors for {rotary_dim // 2} rotary "
                                 "frequencies")
            freq = freq / torch.tensor(freq_factors, dtype=torch.float32)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), freq.to(torch.float32))
        # LongRoPE: (original context, row of position 0's long-factor row) where a prompt
        # can be longer than the original context (long_rope_original), else None.
        self.long_prompt_rows: tuple[int, int] | None = None
        if scaling["rope_type"] == "longrope":
            # Rows [0, max_position): the short factors below the original context, the long
            # ones past it; then rows for the positions below it with the long factors, which
            # a prompt longer than it takes there (the model runner's positions point at them).
            original = int(scaling["original_max_position_embeddings"])
            long = torch.outer(torch.arange(max_position, dtype=torch.float32),
                               longrope_inv_freq(rotary_dim, theta, scaling["long_factor"]))
            freqs[original:] = long[original:]
            if original < max_position:
                self.long_prompt_rows = (original, max_position)
                freqs = torch.cat([freqs, long[:original]])
        cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)  # [max_position, rotary_dim]
        mscale = attention_factor(scaling)
        if mscale != 1.0:
            cache = cache * mscale  # HF scales cos and sin in float32, before the cast
        return cache

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token (cos, signed sin), each [T, 1, R]: cos repeated over both halves and
        sin as (-sin, sin), HF's own cos/sin layout with rotate_half's sign folded in.

        Gathered once per model forward and shared by every layer: the gather and the
        sign flip are the same work in each of them."""
        cos, sin = self.cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)
        return torch.cat((cos, cos), dim=-1)[:, None], torch.cat((-sin, sin), dim=-1)[:, None]

    def rotate(self, cos_sin: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, num_heads: int) -> torch.Tensor:
        """x [T, num_heads*D] (rows may be strided) -> rotated, contiguous [T, num_heads, D].

        With x = (x1, x2) per head, HF computes x*cos + rotate_half(x)*sin, i.e.
        (x1*cos - x2*sin, x2*cos + x1*sin).  Swapping the halves (one cat of two block
        copies; `roll` does the same but cannot be traced for a batch of unknown size)
        and multiplying by the signed sin gives the same products, rounded the same way
        (negating is exact), in 4 ops instead of 7 with full-width operands; q and k of
        one layer go through together."""
        cos, sin = cos_sin
        t, r = x.shape[0], self.rotary_dim
        x = x.view(t, num_heads, self.head_dim)
        rot = x if r == self.head_dim else x[..., :r]
        swapped = torch.cat((rot[..., r // 2:], rot[..., : r // 2]), dim=-1)
        out = (rot * cos).add_(swapped * sin)
        if r != self.head_dim:
            out = torch.cat([out, x[..., r:]], dim=-1)
        return out

    def rotate_qk(self, cos_sin: tuple[torch.Tensor, torch.Tensor], qkv: torch.Tensor, num_heads: int,
                  num_kv_heads: int, norms: tuple[RMSNorm, RMSNorm] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """The fused q|k|v projection [T, (H + 2 KVH) * D] -> rotated q [T, H, D] and
        k [T, KVH, D], each head first RMS-normalised by `norms` (q's, k's; Qwen3) if given.
        One fused kernel where fused_ops has one (CUDA, 16-bit CPU tensors); with the
        torch ops, q and k are rotated as one tensor when there is no norm between the
        projection and the rotation."""
        q_size, kv_size = num_heads * self.head_dim, num_kv_heads * self.head_dim
        weights = (norms[0].weight, norms[1].weight) if norms is not None else None
        kernels = fused_ops.kernels_for(qkv, *cos_sin, *(weights or ()))
        if kernels is not None:
            eps = norms[0].eps if norms is not None else 0.0
            return kernels.norm_rope(qkv, *cos_sin, num_heads, num_kv_heads, self.head_dim, self.rotary_dim,
                                     weights, eps)
        t = qkv.shape[0]
        if norms is None:  # q|k are adjacent in the fused projection: rotate them as one tensor
            qk = self.rotate(cos_sin, qkv[:, : q_size + kv_size], num_heads + num_kv_heads)
            return qk[:, :num_heads], qk[:, num_heads:]
        q, k = qkv[:, :q_size], qkv[:, q_size: q_size + kv_size]
        q = norms[0](q.reshape(t, num_heads, self.head_dim)).view(t, q_size)
        k = norms[1](k.reshape(t, num_kv_heads, self.head_dim)).view(t, kv_size)
        return self.rotate(cos_sin, q, num_heads), self.rotate(cos_sin, k, num_kv_heads)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T]; q [T, H*D] (or [T, H, D]), k likewise -> rotated q, k (same shapes)."""
        cs = self.cos_sin(positions)
        t = q.shape[0]
        qr = self.rotate(cs, q.reshape(t, -1), q.reshape(t, -1).shape[1] // self.head_dim)
        kr = self.rotate(cs, k.reshape(t, -1), k.reshape(t, -1).shape[1] // self.head_dim)
        return qr.view(q.shape), kr.view(k.shape)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, max_position={self.max_position}"


def get_rope(hf_config: Any, head_dim: int, max_position: int, partial: bool = False) -> RotaryEmbedding:
    """The rotary embedding a config asks for; `partial`: its partial_rotary_factor rotates
    only that share of each head (families whose HF code reads the field; the others rotate
    whole heads whatever it says, as HF does)."""
    theta, scaling = rope_config(hf_config)
    factor = scaling.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None)) if partial \
        else None
    rotary_dim = int(head_dim * float(factor or 1.0))
    return RotaryEmbedding(head_dim, rotary_dim, max_position, theta, scaling,
                           getattr(hf_config, "rope_freq_factors", None))

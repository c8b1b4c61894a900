"""The attention layer models call: q/k/v in, attention out, paged KV cache hidden."""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.forward_context import get_forward_context
from pagedserve.layers import opaque


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int,
                 sliding_window: int | None = None) -> None:
        """`sliding_window`: a query at position p attends only keys (p - W, p]."""
        super().__init__()
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be a positive number of tokens or None, got {sliding_window}")
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.sliding_window = sliding_window
        # Bound by the model runner after the KV cache is allocated.
        self.impl = None  # AttentionBackend
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        self.kv_cache_group = 0  # which KV-cache group's block table this layer reads
        self.opaque_index: int | None = None  # set when a compiled model calls this layer (layers/opaque.py)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, H*D], k/v: [T, Hkv*D] -> [T, H*D]."""
        if opaque.tracing(self.opaque_index):
            return opaque.attention_op(q, k, v, self.opaque_index)
        return self.forward_eager(q, k, v)

    def forward_eager(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        t = q.shape[0]
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        metadata = get_forward_context().attn_metadata
        if metadata is None or self.kv_cache is None:
            # Profiling / no cache yet: the whole batch as one causal sequence.
            mask = None
            if self.sliding_window is not None and t > self.sliding_window:
                pos = torch.arange(t, device=q.device)
                mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - self.sliding_window)
            o = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
                is_causal=mask is None, scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads,
            ).transpose(0, 1)
        else:
            o = self.impl.forward(q, k, v, self.kv_cache[0], self.kv_cache[1], metadata[self.kv_cache_group])
        return o.reshape(t, self.num_heads * self.head_dim)

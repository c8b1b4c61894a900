"""The attention layer models call: q/k/v in, attention out, paged KV cache hidden."""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.attention import kv_dtype
from pagedserve.attention.backend import CommonAttentionMetadata, DecodeKernelStep
from pagedserve.forward_context import BidirectionalSpan, get_forward_context
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

    def decode_kernel_step(self, num_rows: int, dtype: torch.dtype) -> DecodeKernelStep | None:
        """This step as one call of the backend's decode kernel (AttentionBackend.
        decode_kernel_step), where forward_eager would make exactly that call; else None."""
        context = get_forward_context()
        metadata = context.attn_metadata
        if metadata is None or self.kv_cache is None or context.bidirectional:
            return None
        return self.impl.decode_kernel_step(num_rows, dtype, self.kv_cache[0], metadata[self.kv_cache_group])

    def forward_eager(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        t = q.shape[0]
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        context = get_forward_context()
        metadata = context.attn_metadata
        if metadata is None or self.kv_cache is None:
            # Profiling / no cache yet: the whole batch as one causal sequence.
            mask = None
            if (self.sliding_window is not None and t > self.sliding_window) or context.bidirectional:
                pos = torch.arange(t, device=q.device)
                mask = self._visible(pos[:, None], pos[None, :])
                for span in context.bidirectional:
                    mask[span.q_start:span.q_end, span.start:span.end] = True
            o = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
                is_causal=mask is None, scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads,
            ).transpose(0, 1)
        else:
            group_metadata = metadata[self.kv_cache_group]
            o = self.impl.forward(q, k, v, self.kv_cache[0], self.kv_cache[1], group_metadata)
            for span in context.bidirectional:
                o[span.q_start:span.q_end] = self._attend_span(q, span, context.common[self.kv_cache_group])
        return o.reshape(t, self.num_heads * self.head_dim)

    def _visible(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """Causal visibility, within the sliding window when the layer has one."""
        mask = k_pos <= q_pos
        if self.sliding_window is not None:
            mask = mask & (k_pos > q_pos - self.sliding_window)
        return mask

    def _attend_span(self, q: torch.Tensor, span: BidirectionalSpan,
                     metadata: CommonAttentionMetadata) -> torch.Tensor:
        """The rows of an image span's queries again, each seeing what causal attention
        shows it plus every key of its image (HF's `or` mask for Gemma 3's image tokens),
        read back from the paged cache in float32 (this step's keys are already written).
        Rare and short (one image's tokens), so plain torch is enough here."""
        bs = metadata.block_size
        q_first = span.end - (span.q_end - span.q_start)  # the first query's position
        lo = 0 if self.sliding_window is None else max(0, min(span.start, q_first - self.sliding_window + 1))
        lo = lo // bs * bs
        blocks = metadata.block_table[span.request_index, lo // bs:(span.end + bs - 1) // bs].long()
        group = self.num_heads // self.num_kv_heads
        k_all, v_all = self.kv_cache
        keys = kv_dtype.gather(k_all, blocks, torch.float32).reshape(-1, self.num_kv_heads, self.head_dim)
        values = kv_dtype.gather(v_all, blocks, torch.float32).reshape(-1, self.num_kv_heads, self.head_dim)
        keys = keys[:span.end - lo].repeat_interleave(group, dim=1).transpose(0, 1)
        values = values[:span.end - lo].repeat_interleave(group, dim=1).transpose(0, 1)
        query = q[span.q_start:span.q_end].float().transpose(0, 1)  # [H, n, D]
        q_pos = torch.arange(q_first, span.end, device=q.device)[:, None]
        k_pos = torch.arange(lo, span.end, device=q.device)[None, :]
        visible = self._visible(q_pos, k_pos) | ((k_pos >= span.start) & (k_pos < span.end))
        scores = torch.matmul(query, keys.transpose(1, 2)) * self.scale
        scores.masked_fill_(~visible, float("-inf"))
        return torch.matmul(scores.softmax(-1), values).transpose(0, 1).to(q.dtype)

"""Pure-torch reference backend: the correctness yardstick for every other backend.

Loops over requests, gathers each one's context from its blocks and does plain
causal attention in float32 (within the sliding window, for a group that has one), from
whatever dtype the cache stores (attention/kv_dtype.py).  Simple on purpose; speed
lives in other backends.
"""

from __future__ import annotations

import torch

from pagedserve.attention import kv_dtype
from pagedserve.attention.backend import AttentionBackend, CommonAttentionMetadata


class TorchReferenceBackend(AttentionBackend):
    name = "torch_ref"

    def forward(self, query, key, value, k_cache, v_cache, attn_metadata: CommonAttentionMetadata):
        metadata = attn_metadata
        num_tokens = metadata.num_actual_tokens
        kv_dtype.store(key[:num_tokens], value[:num_tokens], k_cache, v_cache, metadata.slot_mapping[:num_tokens])
        out = torch.zeros_like(query)
        group = self.num_heads // self.num_kv_heads
        bs = self.block_size
        for i in range(metadata.num_reqs):
            q0, q1 = metadata.query_start_loc_cpu[i], metadata.query_start_loc_cpu[i + 1]
            n, ctx = q1 - q0, metadata.seq_lens_cpu[i]
            # Keys from the block holding the first query's window start (0 without a window).
            w = metadata.sliding_window
            first = max(0, ctx - n - w + 1) // bs * bs if w is not None else 0
            nblocks = (ctx + bs - 1) // bs
            blocks = metadata.block_table[i, first // bs:nblocks].long()
            k = kv_dtype.gather(k_cache, blocks, torch.float32).reshape(-1, self.num_kv_heads, self.head_dim)[:ctx - first]
            v = kv_dtype.gather(v_cache, blocks, torch.float32).reshape(-1, self.num_kv_heads, self.head_dim)[:ctx - first]
            k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, ctx, D]
            v = v.repeat_interleave(group, dim=1).transpose(0, 1)
            q = query[q0:q1].float().transpose(0, 1)  # [H, n, D]
            scores = torch.matmul(q, k.transpose(1, 2)) * self.scale  # [H, n, ctx]
            q_pos = torch.arange(ctx - n, ctx, device=query.device)[:, None]
            k_pos = torch.arange(first, ctx, device=query.device)[None, :]
            hidden = k_pos > q_pos
            if w is not None:
                hidden |= k_pos <= q_pos - w
            scores.masked_fill_(hidden, float("-inf"))
            out[q0:q1] = torch.matmul(scores.softmax(-1), v).transpose(0, 1).to(out.dtype)
        return out

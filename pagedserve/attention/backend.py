"""The attention-backend interface: what the runner builds once per step and what
each attention layer calls.

The runner describes the flattened batch once (`CommonAttentionMetadata`); the
chosen backend turns that into whatever it wants to precompute (`build_metadata`,
once per step, shared by all layers); every layer then calls `forward`, which
writes the new K/V into the paged cache by slot mapping and attends over each
request's blocks.  Model code never sees any of this beyond `Attention.forward`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch


@dataclass
class CommonAttentionMetadata:
    """The flattened batch of one step: B requests, T tokens, no padding."""

    num_reqs: int
    num_actual_tokens: int
    query_start_loc: torch.Tensor  # [B + 1] int32, on device: request i's tokens are [q[i], q[i+1])
    seq_lens: torch.Tensor  # [B] int32, on device: context length after this step's tokens
    block_table: torch.Tensor  # [B, max_blocks] int32, on device; unused entries 0 (null block)
    slot_mapping: torch.Tensor  # [T] int64, on device: flat cache slot of each new token
    # Host copies, so backends can plan without device syncs.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int
    block_size: int
    # The KV-cache group's sliding window: a query at position p sees keys (p - W, p].
    # Blocks before a request's window may be stale or the null block: never read them.
    sliding_window: int | None = None
    # Query rows at positions below this are attended as one-token decode rows, each
    # computed as a decode step computes that token (AttentionBackend.exact_rows_context);
    # 0: only a backend's own short-chunk rule applies.
    exact_rows_context: int = 0


# AttentionBackend.exact_rows_context's "all of them": past any sequence's length.
EVERY_POSITION = 1 << 62


@dataclass(frozen=True)
class DecodeKernelStep:
    """An all-decode step as one call of a backend's decode kernel per layer, for a C++
    caller of that kernel (layers/decode_stack.py): the kernel's per-step arguments,
    shared by every layer of the step's attention group."""

    block_table: torch.Tensor
    seq_lens: torch.Tensor
    window: int  # 0: no sliding window
    slots: torch.Tensor  # the new tokens' cache slots, where the kernel stores key/value first
    fresh_blocks: torch.Tensor | None  # blocks this step opens and does not fill: zeroed in each layer's caches first


class AttentionBackend(ABC):
    """One instance per attention layer shape; stateless across steps."""

    name: str = "abstract"
    # Whether a decode-only step may be captured in a CUDA graph and replayed: the
    # backend's forward launches only device work whose inputs are the metadata's
    # tensors (refilled in place), and makes no host decision from their contents.
    supports_cuda_graphs: ClassVar[bool] = False
    # KV-cache storage dtypes (kv_cache_dtype) the backend cannot read: refused at start-up.
    unsupported_kv_dtypes: ClassVar[tuple[torch.dtype, ...]] = ()

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, block_size: int
    ) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.block_size = block_size

    @classmethod
    def build_metadata(cls, common: CommonAttentionMetadata) -> Any:
        """Once per step, shared by all layers. Default: the common metadata itself."""
        return common

    @classmethod
    def build_capture_metadata(cls, common: CommonAttentionMetadata, num_kv_heads: int) -> Any:
        """Metadata for a padded decode batch that a CUDA graph captures once and replays
        with any contents (seq_lens up to max_seq_len): every host-side plan fixed for the
        longest context.  Only backends with supports_cuda_graphs implement it."""
        raise NotImplementedError(f"attention backend {cls.name!r} does not support CUDA graphs")

    def exact_rows_context(self, device: torch.device, dtype: torch.dtype, cache_dtype: torch.dtype) -> int:
        """How far into a sequence (positions below the returned count) every query row,
        whatever chunk, batch or prefix-cache hit it arrives in, is computed exactly as a
        one-token decode step computes it, so that those tokens' outputs do not depend on
        how the work was cut.  For queries of `dtype` on `device` over a cache of
        `cache_dtype`; the runner takes the smallest over its layers (0 under
        `exact_prompt_attention=False`).  Default: 0 (no such promise); EVERY_POSITION: all."""
        return 0

    def decode_operator(self) -> str | None:
        """The torch operator name of a decode kernel that takes a whole all-decode step
        (see decode_kernel_step), or None where the backend has none (the default)."""
        return None

    def decode_kernel_step(self, num_rows: int, dtype: torch.dtype, k_cache: torch.Tensor,
                           attn_metadata: Any) -> DecodeKernelStep | None:
        """This step as one call of decode_operator per layer, where it is one (an
        all-decode step whose rows are `dtype`, the cache's dtype); else None: the caller
        runs `forward`.  Default: None."""
        return None

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]
        value: torch.Tensor,  # [T, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        attn_metadata: Any,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Store key/value at attn_metadata's slots, then attend causally."""

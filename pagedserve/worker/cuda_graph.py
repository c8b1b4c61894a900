"""CUDA graphs for decode-only steps, as nano-vllm does them.

Why: a decode step of a small model is a few hundred short kernels, and launching
them from Python costs more than running them.  Replaying one captured graph per
step costs one launch.  Only decode-only steps (every request has exactly one new
token) are captured: their shapes depend on the batch size alone, so a handful of
sizes (1, 2, 4, 8, then every 16 up to max_num_seqs) cover every batch, padded up
to the next size.  Anything else (a prefill chunk in the step, a batch above the
largest size) runs eagerly.

What makes a replay valid: the graph reads fixed addresses, so every input lives in
the runner's persistent device buffers (input_ids, positions, slot_mapping,
seq_lens, query_start_loc, block_table), refilled in place each step, and the
attention metadata object is built once per size at capture, pointing at slices of
those buffers (its split count pinned; see triton_backend's notes).  Padding rows
have slot -1 (nothing stored) and seq_len 0 (output zeros), and are never sampled.
All sizes share one memory pool, captured largest first so the smaller ones fit in
what the largest left.

`use_graphs=False` runs the very same static-buffer path eagerly: that is how the
CPU tests check padding and in-place metadata with the Triton interpreter.
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import Any

import torch
from torch import nn

from pagedserve.attention.backend import AttentionBackend, CommonAttentionMetadata
from pagedserve.forward_context import set_forward_context
from pagedserve.platforms import is_cuda

logger = logging.getLogger("pagedserve")


def capture_sizes(max_num_seqs: int, max_num_tokens: int) -> list[int]:
    """1, 2, 4, 8, then steps of 16, and the largest possible batch itself so that
    every decode batch has a graph."""
    limit = min(max_num_seqs, max_num_tokens)
    sizes = [s for s in (1, 2, 4, 8) if s <= limit] + list(range(16, limit + 1, 16))
    if sizes[-1] != limit:
        sizes.append(limit)
    return sizes


def padded_size(sizes: list[int], num_reqs: int) -> int | None:
    """The smallest captured size >= num_reqs, or None (too big: run eagerly)."""
    i = bisect.bisect_left(sizes, num_reqs)
    return sizes[i] if i < len(sizes) else None


def graphs_unavailable_reason(device: torch.device, backend: type[AttentionBackend], enforce_eager: bool,
                              tensor_parallel_size: int = 1, num_kv_groups: int = 1) -> str | None:
    """Why this runner cannot use CUDA graphs, or None when it can."""
    if enforce_eager:
        return "enforce_eager=True"
    if not is_cuda(device):
        return f"device {device} is not CUDA"
    if not backend.supports_cuda_graphs:
        return f"attention backend {backend.name!r} does not support CUDA graphs"
    if tensor_parallel_size > 1:
        return "tensor parallelism (its collectives are not captured)"
    if num_kv_groups > 1:
        return "the model has several KV-cache groups (sliding-window layers); graphs capture one"
    return None


class DecodeGraphRunner:
    def __init__(self, model: nn.Module, backend: type[AttentionBackend], buffers: dict[str, torch.Tensor],
                 sizes: list[int], block_size: int, max_model_len: int,
                 num_kv_heads: int, use_graphs: bool = True, sliding_window: int | None = None) -> None:
        """`sliding_window`: the window of the model's one KV-cache group (None: full
        attention), baked into every captured step's metadata like the split count."""
        self.model = model
        self.backend = backend
        self.buffers = buffers
        self.sizes = sizes
        self.max_size = sizes[-1]
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.num_kv_heads = num_kv_heads
        self.use_graphs = use_graphs
        self.sliding_window = sliding_window
        self.hidden: torch.Tensor | None = None  # [max_size, hidden], from the first warm-up
        self.metadata: dict[int, Any] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.num_replays = 0

    def _build_metadata(self, batch: int) -> Any:
        """Metadata over the first batch rows of the static buffers, valid for any contents."""
        b = self.buffers
        common = CommonAttentionMetadata(
            num_reqs=batch, num_actual_tokens=batch,
            query_start_loc=b["query_start_loc"][: batch + 1], seq_lens=b["seq_lens"][:batch],
            block_table=b["block_table"][0, :batch], slot_mapping=b["slot_mapping"][0, :batch],
            query_start_loc_cpu=list(range(batch + 1)), seq_lens_cpu=[0] * batch,
            max_query_len=1, max_seq_len=self.max_model_len, block_size=self.block_size,
            sliding_window=self.sliding_window,
        )
        return self.backend.build_capture_metadata(common, self.num_kv_heads)

    def _pad_all(self, batch: int) -> None:
        """Every row a padding row: a warm-up that stores nothing and reads nothing."""
        b = self.buffers
        b["input_ids"][:batch].zero_()
        b["positions"][:batch].zero_()
        b["slot_mapping"][0, :batch].fill_(-1)
        b["seq_lens"][:batch].zero_()
        b["query_start_loc"][: batch + 1].copy_(torch.arange(batch + 1, dtype=b["query_start_loc"].dtype))

    def _forward(self, batch: int) -> None:
        with set_forward_context([self.metadata[batch]]):
            out = self.model(self.buffers["input_ids"][:batch], self.buffers["positions"][:batch])
            if self.hidden is None:
                self.hidden = torch.empty((self.max_size, *out.shape[1:]), dtype=out.dtype, device=out.device)
            self.hidden[:batch] = out

    @torch.inference_mode()
    def capture(self) -> None:
        cuda = is_cuda(self.buffers["input_ids"].device)
        if cuda:
            torch.cuda.synchronize()
            free_before = torch.cuda.mem_get_info()[0]
        t0 = time.perf_counter()
        pool = None
        for batch in reversed(self.sizes):
            self.metadata[batch] = self._build_metadata(batch)
            self._pad_all(batch)
            self._forward(batch)  # warm-up: compiles kernels, allocates per-metadata scratch
            if not self.use_graphs:
                continue
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._forward(batch)
            if pool is None:
                pool = graph.pool()
            self.graphs[batch] = graph
        if cuda:
            torch.cuda.synchronize()
            used = free_before - torch.cuda.mem_get_info()[0]
            logger.info("CUDA graphs: %s %d decode sizes (1..%d) in %.1f s, %.0f MiB",
                        "captured" if self.use_graphs else "warmed up", len(self.sizes), self.max_size,
                        time.perf_counter() - t0, used / 2**20)

    def run(self, batch: int) -> torch.Tensor:
        """Replay size batch over the buffers as filled (rows past the batch padded);
        returns the hidden states [batch, hidden], valid until the next run."""
        if self.use_graphs:
            self.graphs[batch].replay()
        else:
            self._forward(batch)
        self.num_replays += 1
        return self.hidden[:batch]

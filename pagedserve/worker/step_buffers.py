"""StepBuffers: the preallocated buffers a step's flattened inputs are written into.

Why a class of its own: the model runner decides *what* a step runs (which requests,
which tokens sample, whether a CUDA graph replays); these buffers are *where* it is
written, with a handful of numpy gathers and no allocation per step.  Host buffers are
pinned on CUDA and come in two sets that alternate, so that preparing step N+1 never
overwrites what step N's non-blocking copies still read; their device twins are also
the CUDA graphs' static inputs (worker/cuda_graph.py), so they never move.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.attention.backend import CommonAttentionMetadata
from pagedserve.platforms import is_cpu, is_cuda
from pagedserve.utils import cdiv
from pagedserve.worker.input_batch import InputBatch

# Buffers with a leading KV-cache-group dimension.
GROUPED_BUFFERS = ("slot_mapping", "block_table")


@dataclass
class StepInputs:
    """What the model runner decided for one step (the tensors are in the buffers)."""

    num_reqs: int
    num_tokens: int
    common: list[CommonAttentionMetadata] | None  # per KV-cache group; None when a CUDA graph replays
    graph_size: int | None  # padded batch size of the graph to replay
    logits_idx: np.ndarray  # flat token index of each sampled request's last token
    sample_rows: list[int]  # indices into the step's requests that sample
    pending: np.ndarray  # [num_reqs] bool: the last scheduled token is still on the device


class StepBuffers:
    """Host buffers filled in place every step (two sets on CUDA, alternating) and their
    device twins on accelerators; `np` and `cpu` are the current set's views."""

    def __init__(self, device: torch.device, max_tokens: int, max_reqs: int, max_blocks_per_req: int,
                 num_kv_groups: int, long_prompt_rows: tuple[int, int] | None = None) -> None:
        """`long_prompt_rows`: a LongRoPE model's (original context, row of position 0 with
        the long factors) (RotaryEmbedding.long_prompt_rows): a request that rotates long
        (InputBatch.long_rope) takes those rows for its positions below the context."""
        self.device = device
        self.long_prompt_rows = long_prompt_rows
        t, r, b, g = max_tokens, max_reqs, max_blocks_per_req, num_kv_groups
        self.arange = np.arange(max(t, r, b) + 1, dtype=np.int64)

        def host() -> dict[str, torch.Tensor]:
            cpu = {
                "input_ids": torch.zeros(t, dtype=torch.int64),
                "positions": torch.zeros(t, dtype=torch.int64),
                "slot_mapping": torch.zeros(g, t, dtype=torch.int64),  # per KV-cache group
                "query_start_loc": torch.zeros(r + 1, dtype=torch.int32),
                "seq_lens": torch.zeros(r, dtype=torch.int32),
                "block_table": torch.zeros(g, r, b, dtype=torch.int32),  # per KV-cache group
                "logits_idx": torch.zeros(r, dtype=torch.int64),
                "pending": torch.zeros(2 * r, dtype=torch.int64),  # token indices, then source indices
            }
            return {k: v.pin_memory() for k, v in cpu.items()} if is_cuda(device) else cpu

        self._host_sets = [host()] if not is_cuda(device) else [host(), host()]
        self._np_sets = [{k: v.numpy() for k, v in h.items()} for h in self._host_sets]
        self._turn = 0
        self.cpu, self.np = self._host_sets[0], self._np_sets[0]
        self.dev = self.cpu if is_cpu(device) else {k: v.to(device) for k, v in self.cpu.items()}

    def next_set(self) -> None:
        """Step N+1 fills the other set: step N's non-blocking copies may still read this one."""
        if len(self._host_sets) > 1:
            self._turn ^= 1
            self.cpu, self.np = self._host_sets[self._turn], self._np_sets[self._turn]

    def to_device(self, name: str, n: int | tuple[int, int]) -> torch.Tensor:
        """The first `n` rows (or [rows, columns]) of a buffer; of every KV-cache group's
        for the grouped ones (slot_mapping, block_table)."""
        grouped = name in GROUPED_BUFFERS

        def part(t: torch.Tensor) -> torch.Tensor:
            if grouped:
                return t[:, :n] if isinstance(n, int) else t[:, : n[0], : n[1]]
            return t[:n] if isinstance(n, int) else t[: n[0], : n[1]]

        src = part(self.cpu[name])
        if is_cpu(self.device):
            return src
        dst = part(self.dev[name])
        dst.copy_(src, non_blocking=True)
        return dst

    def fill_tokens(self, ib: InputBatch, rows: np.ndarray, num_new: np.ndarray, computed: np.ndarray,
                    seq_lens: np.ndarray, padded_reqs: int) -> None:
        """query_start_loc, seq_lens, and per token: position, token id and KV slot
        (block_id * block_size + offset), gathered from the rows with a few numpy ops.
        Padding rows (a CUDA graph's batch beyond the real one) get one token each that
        is stored nowhere (slot -1) and attends over nothing (seq_len 0)."""
        bufs, block_size = self.np, ib.block_size
        num_reqs, num_tokens = len(rows), int(num_new.sum())
        qsl = bufs["query_start_loc"][: padded_reqs + 1]
        qsl[0] = 0
        np.cumsum(num_new, out=qsl[1: num_reqs + 1])
        bufs["seq_lens"][:num_reqs] = seq_lens
        req_of_tok = np.repeat(self.arange[:num_reqs], num_new)
        pos = bufs["positions"][:num_tokens]
        np.subtract(self.arange[:num_tokens], qsl[:num_reqs][req_of_tok], out=pos)
        pos += computed[req_of_tok]
        row_of_tok = rows[req_of_tok]
        bufs["input_ids"][:num_tokens] = ib.token_ids[row_of_tok, pos]  # a pending slot is overwritten on the device
        bufs["slot_mapping"][:, :num_tokens] = (ib.block_table[:, row_of_tok, pos // block_size].astype(np.int64)
                                                * block_size + pos % block_size)
        if self.long_prompt_rows is not None:  # (positions only rotate from here on: the rows they read)
            original, first = self.long_prompt_rows
            pos[ib.long_rope[row_of_tok] & (pos < original)] += first
        if padded_reqs > num_reqs:
            end = num_tokens + padded_reqs - num_reqs
            qsl[num_reqs + 1:] = self.arange[num_tokens + 1: end + 1]
            bufs["seq_lens"][num_reqs:padded_reqs] = 0
            bufs["input_ids"][num_tokens:end] = 0
            bufs["positions"][num_tokens:end] = 0
            bufs["slot_mapping"][:, num_tokens:end] = -1

    def fill_block_table(self, ib: InputBatch, rows: np.ndarray, max_seq_len: int) -> int:
        """The rows' block tables (every KV-cache group's), as wide as the longest request
        needs; returns that width."""
        max_blocks = cdiv(max_seq_len, ib.block_size)
        table = ib.block_table[:, rows, :max_blocks]
        # Entries past a request's own blocks may be stale from a row's previous owner: point them at block 0.
        own = self.arange[:max_blocks][None, :] < ib.num_blocks[rows][:, None]
        self.np["block_table"][:, : len(rows), :max_blocks] = np.where(own[None], table, 0)
        return max_blocks

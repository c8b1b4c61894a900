"""Token embedding and LM head, split by vocabulary rows so tensor parallelism can shard them.

With tied embeddings the LM head does not own a weight: it reads the embedding's
Parameter, so a checkpoint that carries only `embed_tokens` (or both, identical)
loads once and the two can never drift apart.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.distributed.communication import gather_to_driver, tensor_model_parallel_all_reduce
from pagedserve.layers import opaque
from pagedserve.layers.linear import PackedLinear, get_tp_rank_size
from pagedserve.layers.quantization import (
    DEFAULT_ACTIVATION_BITS,
    BlockWeights,
    QuantizedWeight,
    as_block_weights,
)
from pagedserve.layers.vocab_reduce import row_topk_indices
from pagedserve.utils import cdiv


class VocabParallelEmbedding(nn.Module):
    """Rank r holds vocabulary rows [r * rows, (r + 1) * rows) with rows = ceil(vocab / tp);
    the last rank's tail past the vocabulary is zero padding, so any vocab size shards."""

    def __init__(self, num_embeddings: int, embedding_dim: int, shared_weight: nn.Parameter | None = None) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank_size()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.rows = cdiv(num_embeddings, self.tp_size)
        self.row_start = self.tp_rank * self.rows
        self.valid_rows = max(0, min(self.rows, num_embeddings - self.row_start))  # < rows only on the last rank
        self._linear = PackedLinear()  # used by the LM head (its own, or the tied embedding's)
        self.quant_method: str | None = None
        self.activation_bits = DEFAULT_ACTIVATION_BITS
        self.qweight: QuantizedWeight | None = None
        self.opaque_index: int | None = None  # set when a compiled model calls this layer (layers/opaque.py)
        if shared_weight is not None:
            self.weight = shared_weight
            return
        self.weight = nn.Parameter(torch.empty(self.rows, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def enable_quantization(self, method: str, weight: torch.Tensor | None = None,
                            activation_bits: int = DEFAULT_ACTIVATION_BITS) -> None:
        """Keep the table quantized (see LinearBase.enable_quantization; under "gguf" only
        when the file's table is quantized): lookups dequantize the rows they read, and an
        LM head that reads it multiplies by it directly.  A float table is quantized to
        int8 whatever `method` says: its rows are read one token at a time (lookups) or
        once per step (the head), so 4 bits would save little time and cost accuracy
        where it shows most."""
        self.quant_method = "int8" if method == "int4" else method
        self.activation_bits = activation_bits
        if weight is not None:
            self._store_local(weight)

    def set_prepack(self, enabled: bool) -> None:
        self._linear.prepack = enabled

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor | BlockWeights,
                      shard_id: object = None) -> None:
        if shard_id is not None:
            raise ValueError(f"embedding has no shard {shard_id!r}")
        if tuple(loaded_weight.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(
                f"shape mismatch for embedding: model expects {(self.num_embeddings, self.embedding_dim)}, "
                f"checkpoint has {tuple(loaded_weight.shape)}"
            )
        mine = loaded_weight.narrow(0, self.row_start, self.valid_rows)
        if self.quant_method is not None and (self.quant_method != "gguf" or isinstance(mine, BlockWeights)):
            self._store_local(mine)
            return
        if isinstance(mine, BlockWeights):
            mine = mine.dequantize()
        if self.valid_rows:
            param.data[: self.valid_rows].copy_(mine)
        param.data[self.valid_rows:].zero_()
        self._linear.invalidate()

    def _store_local(self, mine: torch.Tensor | BlockWeights) -> None:
        """This rank's rows into the quantized table; the last rank's padding rows are zero blocks."""
        assert self.quant_method is not None
        if self.qweight is None:
            self.qweight = QuantizedWeight(self.rows, self.embedding_dim, self.activation_bits)
            self.weight.data = torch.empty(self.rows, 0, dtype=self.weight.dtype, device=self.weight.device)
            self._linear.invalidate()
        blocks = as_block_weights(mine[: self.valid_rows] if isinstance(mine, torch.Tensor) else mine,
                                  self.quant_method)
        if self.valid_rows < self.rows:
            pad = self.rows - self.valid_rows
            blocks = BlockWeights(
                blocks.kind, torch.cat([blocks.codes, blocks.codes.new_zeros(pad, blocks.shape[1])]),
                torch.cat([blocks.d, blocks.d.new_zeros(pad, blocks.d.shape[1])]),
                None if blocks.m is None else torch.cat([blocks.m, blocks.m.new_zeros(pad, blocks.m.shape[1])]),
                blocks.source_type)
        self.qweight.store(0, blocks)

    def lookup_eager(self, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (local, valid) of the table, in the model's dtype."""
        if self.qweight is not None:
            return self.qweight.rows(ids).to(weight.dtype).view(*ids.shape, self.embedding_dim)
        return F.embedding(ids, weight)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.qweight is not None and opaque.tracing(self.opaque_index):  # (a float table traces as is)
            return opaque.embedding_op(ids, self.weight, self.embedding_dim, self.opaque_index)
        return self.lookup_eager(ids, self.weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._lookup(input_ids)
        local = input_ids - self.row_start
        mine = (local >= 0) & (local < self.valid_rows)
        y = self._lookup(local.clamp(0, self.rows - 1)) * mine.unsqueeze(-1).to(self.weight.dtype)
        return tensor_model_parallel_all_reduce(y)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


EXACT_TOP = 8  # 16-bit logits recomputed in float32 per row (see ParallelLMHead._exact_top)
# torch.mm(..., out_dtype=torch.float32) for 16-bit CUDA inputs came with torch 2.8.
FLOAT32_OUT_GEMM = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 8)


class ParallelLMHead(VocabParallelEmbedding):
    """hidden -> float32 logits over the full vocabulary."""

    def __init__(self, num_embeddings: int, embedding_dim: int,
                 tied_to: VocabParallelEmbedding | None = None) -> None:
        super().__init__(num_embeddings, embedding_dim, tied_to.weight if tied_to is not None else None)
        # The tied embedding, held outside the module tree (it is registered under the model already).
        self._tied: tuple[VocabParallelEmbedding, ...] = (tied_to,) if tied_to is not None else ()
        if tied_to is not None:  # one packed copy, dropped when the embedding loads
            self._linear = tied_to._linear

    def enable_quantization(self, method: str, weight: torch.Tensor | None = None,
                            activation_bits: int = DEFAULT_ACTIVATION_BITS) -> None:
        if not self._tied:  # a tied head multiplies by the embedding's quantized table
            super().enable_quantization(method, weight, activation_bits)

    def _quantized(self) -> QuantizedWeight | None:
        return self._tied[0].qweight if self._tied else self.qweight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Rank 0 gets the full [N, vocab] logits; other tensor-parallel ranks send
        their slice to it and get None (only rank 0 samples)."""
        quantized = self._quantized()
        if quantized is not None:
            logits = quantized.matmul(hidden)
            mine = logits[:, : self.valid_rows]  # (a view: settled in place)
            if mine.numel():
                self._exact_top(mine, lambda top: quantized.row_dots(top, hidden))
        elif (FLOAT32_OUT_GEMM and hidden.is_cuda and hidden.dtype in (torch.bfloat16, torch.float16)
                and self.tp_size == 1):
            # The GEMM accumulates in float32 and writes float32: no 16-bit rounding of
            # the logits, so no tied top tokens to recompute (see _exact_top).
            return torch.mm(hidden, self.weight.t(), out_dtype=torch.float32)
        else:
            logits = self._linear(hidden, self.weight, None).float()
            mine = logits[:, : self.valid_rows]
            if hidden.dtype in (torch.bfloat16, torch.float16) and mine.numel():
                self._exact_top(mine, lambda top: self._float32_dots(top, hidden))
        if self.tp_size == 1:
            return mine
        # Each rank settled its own slice's top tokens (the vocabulary's top tokens are
        # among them), so the gathered row resolves ties as one rank would.
        logits = gather_to_driver(logits, self.tp_rank, self.tp_size)
        return None if logits is None else logits[:, : self.num_embeddings]

    def _exact_top(self, logits: torch.Tensor, dots: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Recompute each row's EXACT_TOP largest logits in float32, in place (`dots(top)`:
        the float32 dot products of rows `top` [N, k] of the head's weight with each
        row's hidden state).

        A 16-bit matmul rounds its output to 16 bits: logits near 25 are multiples of
        0.125 in bf16, so the top two tokens often come out equal and argmax picks the
        lower id whatever the exact values say (SmolLM2 answering "What is the capital
        of France?" in bf16: 'L' and 'The' both 25.125, exactly 25.139 and 25.178).  A
        quantized head rounds the hidden state instead: to 8 bits (the opt-in) it moves
        logits by about as much, to 16 bits by ~1e-4.  The same inputs dotted in float32
        for the few tokens that can win settle greedy choices and the top logprobs; the
        rest of the row keeps the fast values.  A quantized head's dots are one C++ call
        (QuantizedWeight.row_dots: ~0.1 ms a step less than gathering and multiplying
        the rows in torch, a 2-core Zen 2)."""
        top = row_topk_indices(logits, EXACT_TOP)  # [N, k]
        logits.scatter_(1, top, dots(top))

    def _float32_dots(self, top: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """[N, k]: rows `top` of the 16-bit weight dotted with `hidden` in float32.
        Multiply and sum, not bmm: a row's result must not depend on how many rows there
        are (MKL's batched product rounds one row differently from several), or greedy
        choices would change with the batch, and speculative decoding's verified rows
        would differ from one-token steps."""
        n, k = top.shape
        w = self.weight.index_select(0, top.reshape(-1)).view(n, k, -1).float()
        return (w * hidden.float().unsqueeze(1)).sum(-1)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:  # type: ignore[override]
        return self.compute_logits(hidden)

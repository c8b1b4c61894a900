"""Linear layers whose parameters know how to load (their shard of) a checkpoint tensor.

The model never copies checkpoint tensors itself: every parameter carries a
`weight_loader(param, loaded_weight, shard_id=None)`.  That is what lets one fused
parameter (q|k|v, gate|up) be filled from several checkpoint tensors, and what will
let tensor parallelism slice a tensor per rank without touching model code: a layer
asks `get_tp_rank_size()` (pagedserve.distributed.parallel_state) once, when built.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.distributed.communication import tensor_model_parallel_all_reduce
from pagedserve.distributed.parallel_state import get_tp_group
from pagedserve.layers import opaque
from pagedserve.layers.lora import LinearLoRA
from pagedserve.layers.quantization import (
    DEFAULT_ACTIVATION_BITS,
    BlockWeights,
    QuantizedWeight,
    as_block_weights,
)
from pagedserve.platforms import is_cpu


def get_tp_rank_size() -> tuple[int, int]:
    """(rank, world size) of the tensor-parallel group the layers being built belong to."""
    group = get_tp_group()
    return group.rank, group.world_size


def _check_shape(what: str, expected: torch.Size, got: torch.Size) -> None:
    if tuple(expected) != tuple(got):
        raise ValueError(f"shape mismatch for {what}: model expects {tuple(expected)}, checkpoint has {tuple(got)}")


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
    """Whole-tensor copy for parameters that are neither fused nor sharded (norms)."""
    if shard_id is not None:
        raise ValueError(f"unexpected shard {shard_id!r} for an unfused parameter")
    _check_shape("parameter", param.shape, loaded_weight.shape)
    param.data.copy_(loaded_weight)


class PackedLinear:
    """y = x W^T (+ b) that, for bfloat16 on CPU, keeps W pre-packed in oneDNN's blocked layout.

    F.linear re-lays-out a bf16 weight for oneDNN on every call: for decode-sized
    inputs that reorder is 20-45% of the matmul's time.  Packing once (as inductor's
    weight freezing does) runs the same oneDNN kernel, so results are bitwise equal
    (checked against F.linear at 1..1252 rows, with and without bias); the cost is a
    second, packed copy of each bf16 linear weight in memory.  The pack is redone when
    the weight's storage or version changes (`invalidate()` for writes through
    `.data`, which torch does not count), and any failure (a build without oneDNN
    bf16) falls back to F.linear for the rest of the process.
    """

    enabled = True  # class-wide: cleared on the first failure

    def __init__(self) -> None:
        self._key: tuple[int, int] | None = None
        self._packed: torch.Tensor | None = None
        self.prepack = True  # per layer: off (ModelConfig.prepack_weights) keeps one copy of each weight

    def invalidate(self) -> None:
        self._key = self._packed = None

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if (x.dtype is torch.float32 and weight.dtype is torch.float32 and is_cpu(x.device)
                and x.numel() // max(x.shape[-1], 1) in SWAPPED_FLOAT32_ROWS):
            return _swapped_float32(x, weight, bias)
        if not (PackedLinear.enabled and self.prepack and x.dtype is torch.bfloat16 and weight.dtype is torch.bfloat16
                and is_cpu(x.device) and is_cpu(weight.device) and not torch.is_grad_enabled()):
            return F.linear(x, weight, bias)
        key = (weight.data_ptr(), weight._version)
        try:
            if self._key != key:
                self._packed, self._key = torch.ops.mkldnn._reorder_linear_weight(weight.detach()), key
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, bias, "none", [None], "")
        except (RuntimeError, AttributeError, NotImplementedError):
            PackedLinear.enabled = False
            self.invalidate()
            return F.linear(x, weight, bias)


# Row counts for which a float32 CPU linear runs as (W x^T)^T (see _swapped_float32).
SWAPPED_FLOAT32_ROWS = range(2, 5)


def _swapped_float32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T (+ b) for 2-4 rows of float32 on CPU, computed as (W x^T)^T.

    torch 2.13's CPU GEMM (MKL) takes a slow path for x W^T with a handful of rows:
    1.2-7x slower than the same product with the operands swapped, whose values agree to
    float32 rounding (bitwise at the measured shapes; Zen 4, also under AVX2 emulation: SmolLM2's 49,152 x 576 head
    at 3 rows 37 ms against 6, Gemma 3's 262,144 x 640 head 220 ms against 26, an
    8,192 x 2,048 projection 12 against 4; `python -m pagedserve.benchmarks.bench_quant`
    prints the last).  Every linear of a float32 decode step of 2-4 requests hits
    it.  One row (a matrix-vector product) and more than 4 keep F.linear, which is as
    fast or faster there."""
    out = torch.mm(weight, x.reshape(-1, x.shape[-1]).t()).t().contiguous()
    if bias is not None:
        out.add_(bias)
    return out.view(*x.shape[:-1], weight.shape[0])


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what}={n} is not divisible by tensor_parallel_size={d}")
    return n // d


class LinearBase(nn.Module):
    """y = x W^T (+ b); W is [out_features, in_features] as in HF checkpoints.

    `tp_dim` is the dimension of W split across ranks (0: output, 1: input, None: replicated).
    """

    tp_dim: int | None = None

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank_size()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        self._linear = PackedLinear()
        self.opaque_index: int | None = None  # set when a compiled model calls this layer (layers/opaque.py)
        self.quant_method: str | None = None
        self.activation_bits = DEFAULT_ACTIVATION_BITS
        self.qweight: QuantizedWeight | None = None
        self._float_rows: list[tuple[int, int]] = []  # (offset, rows) loaded as float under "gguf"
        self.lora: LinearLoRA | None = None  # set by the LoRA manager when adapters are enabled

    def enable_quantization(self, method: str, weight: torch.Tensor | None = None,
                            activation_bits: int = DEFAULT_ACTIVATION_BITS) -> None:
        """Keep the weight quantized: "int8"/"int4" quantize float tensors as they load
        (`weight`: these values, now); "gguf" keeps a GGUF's quantized blocks as they
        come and leaves a layer whose tensors are all float in the file float.  The float
        weight becomes an empty [N, 0] placeholder (it still tells a compiled graph the
        output width).  `activation_bits`: what the kernel rounds activations to (16 or 8)."""
        self.quant_method = method
        self.activation_bits = activation_bits
        if method != "gguf":
            self._to_quantized()
        if weight is not None:
            self.store_rows(self.weight, 0, weight)

    def _to_quantized(self) -> None:
        """Switch to a quantized weight; rows that arrived as float so far are quantized too."""
        assert self.quant_method is not None
        self.qweight = QuantizedWeight(self.out_features, self.in_features, self.activation_bits)
        for offset, n in self._float_rows:
            self.qweight.store(offset, as_block_weights(self.weight.data[offset: offset + n], self.quant_method))
        self.weight.data = torch.empty(self.out_features, 0, dtype=self.weight.dtype, device=self.weight.device)
        self._linear.invalidate()

    def set_prepack(self, enabled: bool) -> None:
        self._linear.prepack = enabled

    def logical_shape(self, param: nn.Parameter) -> tuple[int, ...]:
        """The parameter's shape as the checkpoint sees it (a quantized weight's placeholder is [N, 0])."""
        return (self.out_features, self.in_features) if param is self.weight else tuple(param.shape)

    def linear_eager(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.qweight is not None:
            y = self.qweight.linear(x)
            y = y if bias is None else y + bias
        else:
            y = self._linear(x, weight, bias)
        # Adapters' products (per row group) join before a row-parallel layer's all-reduce:
        # each rank adds its input slice's share, as for the base weight.
        return y if self.lora is None else self.lora.apply(x, y)

    def _project(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        qweight = self.qweight
        if qweight is not None and self.lora is None:  # a torch operator: a compiled graph calls it directly
            return qweight.linear(x) if bias is None else qweight.linear(x) + bias
        if opaque.tracing(self.opaque_index):
            return opaque.linear_op(x, self.weight, bias, self.opaque_index)
        return self.linear_eager(x, self.weight, bias)

    def _forward_is_one_product(self) -> bool:
        """forward computes its weight's product and nothing more (no adapters, no
        tensor-parallel all-reduce)."""
        return self.lora is None and self.tp_size == 1

    def direct_quantized(self) -> QuantizedWeight | None:
        """The quantized weight whose kernel call is all `forward` does (no bias either),
        for a C++ caller of the kernel (layers/decode_stack.py); else None."""
        return self.qweight if self._forward_is_one_product() and self.bias is None else None

    def direct_call(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """`forward` as one plain call, for a decoder layer's direct calls (bind_direct): the
        projection `forward` makes, without the module's dispatch; None under tensor
        parallelism (forward all-reduces).  The product is linear_eager's, the one rule for
        it, adapters' products included (so that enabling LoRA leaves the base model's rows
        computed as without it); a quantized weight without bias or adapters calls its
        kernel with no wrapper."""
        if self.tp_size != 1:
            return None
        quantized = self.direct_quantized()
        if quantized is not None:
            return quantized.linear
        weight, bias, project = self.weight, self.bias, self.linear_eager
        return lambda x: project(x, weight, bias)

    def store_rows(self, param: nn.Parameter, offset: int, rows: torch.Tensor | BlockWeights) -> None:
        """Rows [offset, offset + len(rows)) of `param` from (this rank's slice of) a checkpoint tensor."""
        if param is self.weight and self.quant_method is not None:
            if self.qweight is None and isinstance(rows, BlockWeights):
                self._to_quantized()
            if self.qweight is not None:
                self.qweight.store(offset, as_block_weights(rows, self.quant_method))
                return
            self._float_rows.append((offset, rows.shape[0]))
        if isinstance(rows, BlockWeights):
            rows = rows.dequantize()
        param.data.narrow(0, offset, rows.shape[0]).copy_(rows)
        self._linear.invalidate()

    def shard_rows(self, shard_id: object = None) -> tuple[int, int, int, int]:
        """Where shard `shard_id` (None: the whole output) of a checkpoint's [out, in] tensor
        goes on this rank: (row offset in this rank's output, rows, first row taken from
        the checkpoint tensor, the tensor's rows).  The weight loaders and the LoRA
        manager's B matrices both place rows by it."""
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} has no shard {shard_id!r}")
        if self.tp_dim == 0:
            return 0, self.out_features, self.tp_rank * self.out_features, self.out_features * self.tp_size
        return 0, self.out_features, 0, self.out_features

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} has no shard {shard_id!r}")
        shape = self.logical_shape(param)
        dim = self.tp_dim
        if dim is not None and dim < len(shape):
            size = shape[dim]
            _check_shape("parameter", shape[:dim] + (size * self.tp_size,) + shape[dim + 1:], loaded_weight.shape)
            loaded_weight = loaded_weight.narrow(dim, self.tp_rank * size, size)
        _check_shape("parameter", shape, loaded_weight.shape)
        self.store_rows(param, 0, loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._project(x, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class ReplicatedLinear(LinearBase):
    """The full weight on every rank."""


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; each rank's output is its slice (no communication)."""

    tp_dim = 0

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        _, tp_size = get_tp_rank_size()
        super().__init__(in_features, _divide(out_features, tp_size, "out_features"), bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs fused into one matmul (gate|up); shard_id = index."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(in_features, sum(output_sizes), bias)
        self.weight.shard_ids = list(range(len(output_sizes)))
        if self.bias is not None:
            self.bias.shard_ids = list(range(len(output_sizes)))

    def shard_rows(self, shard_id: object = None) -> tuple[int, int, int, int]:
        if shard_id is None:
            return super().shard_rows(None)
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"merged linear needs a shard index in [0, {len(self.output_sizes)}), got {shard_id!r}")
        size = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        return offset, size, self.tp_rank * size, self.output_sizes[shard_id]

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        if shard_id is None:
            raise ValueError(f"merged linear needs a shard index in [0, {len(self.output_sizes)}), got None")
        offset, size, start, total = self.shard_rows(shard_id)
        _check_shape(f"shard {shard_id}", (total,) + self.logical_shape(param)[1:], loaded_weight.shape)
        self.store_rows(param, offset, loaded_weight.narrow(0, start, size))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections as one matmul; shard_id in ("q", "k", "v").

    With more ranks than KV heads each KV head is replicated on tp_size / num_kv_heads ranks.
    """

    def __init__(self, hidden_size: int, head_dim: int, total_num_heads: int,
                 total_num_kv_heads: int, bias: bool = False) -> None:
        _, tp_size = get_tp_rank_size()
        self.head_dim = head_dim
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        self.num_heads = _divide(total_num_heads, tp_size, "num_attention_heads")
        if total_num_kv_heads >= tp_size:
            self.num_kv_heads = _divide(total_num_kv_heads, tp_size, "num_key_value_heads")
        else:
            _divide(tp_size, total_num_kv_heads, "tp_size / num_key_value_heads")
            self.num_kv_heads = 1
        out = (total_num_heads + 2 * self.num_kv_heads * tp_size) * head_dim
        super().__init__(hidden_size, out, bias)
        self.weight.shard_ids = ["q", "k", "v"]
        if self.bias is not None:
            self.bias.shard_ids = ["q", "k", "v"]

    def shard_rows(self, shard_id: object = None) -> tuple[int, int, int, int]:
        if shard_id is None:
            return super().shard_rows(None)
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        if shard_id == "q":
            offset, size, total, rank = 0, q_size, self.total_num_heads * self.head_dim, self.tp_rank
        elif shard_id in ("k", "v"):
            offset = q_size if shard_id == "k" else q_size + kv_size
            size, total = kv_size, self.total_num_kv_heads * self.head_dim
            rank = self.tp_rank // max(1, self.tp_size // self.total_num_kv_heads)
        else:
            raise ValueError(f"QKV linear needs shard 'q', 'k' or 'v', got {shard_id!r}")
        return offset, size, rank * size, total

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        if shard_id is None:
            raise ValueError("QKV linear needs shard 'q', 'k' or 'v', got None")
        offset, size, start, total = self.shard_rows(shard_id)
        _check_shape(f"shard {shard_id}", (total,) + self.logical_shape(param)[1:], loaded_weight.shape)
        self.store_rows(param, offset, loaded_weight.narrow(0, start, size))


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs are summed (bias added once)."""

    tp_dim = 1

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        _, tp_size = get_tp_rank_size()
        super().__init__(_divide(in_features, tp_size, "in_features"), out_features, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._project(x, self.bias if self.tp_rank == 0 else None)
        if self.tp_size > 1:
            tensor_model_parallel_all_reduce(y)
        return y

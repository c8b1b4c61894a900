"""Custom ops that keep a layer's eager code out of a torch.compile graph.

Two kinds of layer must stay opaque when the decoder is compiled
(worker/compiled_model.py):
  * attention: its per-step metadata (groups, block tables, Python loops over them)
    would otherwise be traced into the graph and guard on every step's shapes;
  * quantized embeddings: their C++ row lookup;
  * linears: they call oneDNN (or the quantized kernel) with a weight packed once (`PackedLinear`), an opaque
    tensor that fake tensors cannot trace, and inductor's own bf16 matmuls re-pack the
    weight on every call.
Everything between them (norms, residual adds, rotary, SwiGLU) is what compiling
fuses.  A custom op can carry only tensors and numbers, so it names its layer by an
index into `ForwardContext.modules`, which the compiled model sets around each call;
the layer's tensors (q/k/v, the linear's input, weight and bias) are the op's inputs,
so the graph still sees every data dependency.  Outside a compile trace the layers
run their eager code directly and these ops are never called.
"""

from __future__ import annotations

import torch

from pagedserve.forward_context import get_forward_context


@torch.library.custom_op("pagedserve::attention", mutates_args=())
def attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    """Attention layer `layer` (an index into the forward context's modules): q [T, H*D] -> [T, H*D].
    Writes the new K/V into that layer's paged cache, which the graph never sees."""
    return get_forward_context().modules[layer].forward_eager(q, k, v)


@attention_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    return q.new_empty(q.shape)


@torch.library.custom_op("pagedserve::linear", mutates_args=())
def linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layer: int) -> torch.Tensor:
    """x W^T (+ b) by linear layer `layer`'s own (pre-packed) kernel."""
    return get_forward_context().modules[layer].linear_eager(x, weight, bias)


@linear_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layer: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("pagedserve::embedding", mutates_args=())
def embedding_op(ids: torch.Tensor, weight: torch.Tensor, dim: int, layer: int) -> torch.Tensor:
    """Rows `ids` of embedding layer `layer`'s (quantized) table."""
    return get_forward_context().modules[layer].lookup_eager(ids, weight)


@embedding_op.register_fake
def _(ids: torch.Tensor, weight: torch.Tensor, dim: int, layer: int) -> torch.Tensor:
    return weight.new_empty(*ids.shape, dim)


def tracing(layer_index: int | None) -> bool:
    """True when a layer registered at `layer_index` is being traced by torch.compile."""
    return layer_index is not None and torch.compiler.is_compiling()

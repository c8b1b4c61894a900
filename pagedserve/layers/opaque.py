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

from collections.abc import Callable
from typing import Any

import torch

from pagedserve.forward_context import get_forward_context

# Defined on a plain library fragment, not with torch.library.custom_op: custom_op wraps
# each call in more Python frames (dynamo disabled, alias checks): 5.2 against 2.9 us a
# call on a Zen 4 (AVX-512 with native bf16), and the compiled graph calls attention once a layer.  (The kernels
# return new tensors, as the schemas' lack of alias annotations says.)
_LIB = torch.library.Library("pagedserve", "FRAGMENT")


def _define(schema: str, kernel: Callable[..., torch.Tensor], fake: Callable[..., torch.Tensor]) -> Any:
    """Op `pagedserve::<schema>` running `kernel` (any device), traced by `fake`."""
    name = schema.split("(", 1)[0]
    _LIB.define(schema)
    _LIB.impl(name, kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"pagedserve::{name}", fake, lib=_LIB)
    return getattr(torch.ops.pagedserve, name).default


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    """Attention layer `layer` (an index into the forward context's modules): q [T, H*D] -> [T, H*D].
    Writes the new K/V into that layer's paged cache, which the graph never sees."""
    return get_forward_context().modules[layer].forward_eager(q, k, v)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layer: int) -> torch.Tensor:
    """x W^T (+ b) by linear layer `layer`'s own (pre-packed) kernel."""
    return get_forward_context().modules[layer].linear_eager(x, weight, bias)


def _embedding(ids: torch.Tensor, weight: torch.Tensor, dim: int, layer: int) -> torch.Tensor:
    """Rows `ids` of embedding layer `layer`'s (quantized) table."""
    return get_forward_context().modules[layer].lookup_eager(ids, weight)


attention_op = _define("attention(Tensor q, Tensor k, Tensor v, int layer) -> Tensor", _attention,
                       lambda q, k, v, layer: q.new_empty(q.shape))
linear_op = _define("linear(Tensor x, Tensor weight, Tensor? bias, int layer) -> Tensor", _linear,
                    lambda x, weight, bias, layer: x.new_empty(*x.shape[:-1], weight.shape[0]))
embedding_op = _define("embedding(Tensor ids, Tensor weight, int dim, int layer) -> Tensor", _embedding,
                       lambda ids, weight, dim, layer: weight.new_empty(*ids.shape, dim))


def tracing(layer_index: int | None) -> bool:
    """True when a layer registered at `layer_index` is being traced by torch.compile."""
    return layer_index is not None and torch.compiler.is_compiling()

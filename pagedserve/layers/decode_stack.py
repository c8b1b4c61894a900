"""A decoder's layers for one all-decode CPU step as one C++ call (fused_cpu.cpp's
DecodeStack).

Why: with each layer already a handful of direct kernel calls (LlamaDecoderLayer.
bind_direct), the Python between those calls was what was left: ~40 us a layer,
1.2 ms of SmolLM2-135M's 6 ms decode step (Zen 5, AVX-512 with native bf16), which is
what one stream waits for.  The stack makes the same calls in the same order from C++
(the quantized projections and the attention kernel through torch's dispatcher), so its
outputs are bitwise the direct path's; any step the attention kernel does not take
whole (a prompt chunk, an 8-bit cache, images) runs the layers as before.  A 16-bit cache
under float32 compute (`--kv-cache-dtype float16` where float32 is the default) is the
kernel's to fill: it converts each new row as the layer's own store does.

It binds only where every layer's work is those kernels: quantized projections without
bias or adapters, the fused C++ norms, rotary and SiLU, and the C++ decode-attention
kernel over one KV-cache group.  It holds the weights' packed tensors and the KV caches
it was built with: a model whose weights or caches are replaced must bind again (today
both are set once, before binding).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from pagedserve.layers.attention import Attention
from pagedserve.layers.cpu_fused import fused_kernel
from pagedserve.layers.quantization import QuantizedWeight, quant_kernel

logger = logging.getLogger("pagedserve")


@dataclass(frozen=True)
class StackLayerSpec:
    """One Llama-family decoder layer as the stack runs it (LlamaDecoderLayer.stack_spec)."""

    ln1: tuple[torch.Tensor, float]  # the norm before attention: weight, eps
    ln2: tuple[torch.Tensor, float]  # the norm before the MLP
    qkv: QuantizedWeight
    o: QuantizedWeight
    gate_up: QuantizedWeight
    down: QuantizedWeight
    qk_norms: tuple[torch.Tensor, torch.Tensor] | None  # Qwen3's per-head q and k norm weights
    qk_norm_eps: float
    attention: Attention
    rotary_dim: int


class NativeStack(Protocol):
    """fused_cpu.cpp's DecodeStack, as built by build_decode_stack."""

    def run(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, block_table: torch.Tensor,
            seq_lens: torch.Tensor, window: int, slots: torch.Tensor, fresh_blocks: torch.Tensor | None
            ) -> tuple[torch.Tensor, torch.Tensor]: ...


class DecodeStack:
    """The native stack and the first layer's attention, which decides each step whether
    the kernel takes it whole (every layer reads the same attention group)."""

    def __init__(self, native: NativeStack, attention: Attention) -> None:
        self._native = native
        self._attention = attention

    def run(self, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
            ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(hidden, residual) after the last layer, before the final norm; None when this
        step is not one the decode kernel takes whole (the caller runs the layers)."""
        if hidden.dim() != 2 or hidden.stride(1) != 1:  # (the layers take any layout; the stack, rows)
            return None
        step = self._attention.decode_kernel_step(hidden.shape[0], hidden.dtype)
        if step is None:
            return None
        return self._native.run(hidden, rope[0], rope[1], step.block_table, step.seq_lens, step.window, step.slots,
                                step.fresh_blocks)


def build_decode_stack(specs: Sequence[StackLayerSpec]) -> DecodeStack | None:
    """The stack over `specs`, or None where it cannot run them: no layers, layers on
    different KV-cache groups or attention shapes, or a backend without a decode kernel."""
    if not specs:
        return None
    first = specs[0].attention
    operator = first.impl.decode_operator() if first.impl is not None else None
    if operator is None or first.kv_cache is None:
        return None
    shape = (first.num_heads, first.num_kv_heads, first.head_dim, first.scale, first.kv_cache_group, first.impl.name)
    if any((s.attention.num_heads, s.attention.num_kv_heads, s.attention.head_dim, s.attention.scale,
            s.attention.kv_cache_group, s.attention.impl.name) != shape or s.attention.kv_cache is None
           or s.rotary_dim != specs[0].rotary_dim for s in specs):
        return None
    kernels = fused_kernel()

    def projection(w: QuantizedWeight) -> object:
        codes, d, aux, kinds, ns, offsets, n, k, bits = w.kernel_args()
        return kernels.Projection(codes, d, aux, kinds, ns, offsets, n, k, bits)

    try:  # (the operators looked up by name and signature)
        native = kernels.DecodeStack(quant_kernel().__name__, operator, first.num_heads,
                                     first.num_kv_heads, first.head_dim, specs[0].rotary_dim, first.scale)
        for s in specs:
            q_norm, k_norm = s.qk_norms if s.qk_norms is not None else (None, None)
            k_cache, v_cache = s.attention.kv_cache
            native.add_layer(s.ln1[0], s.ln1[1], s.ln2[0], s.ln2[1], projection(s.qkv), projection(s.o),
                             projection(s.gate_up), projection(s.down), q_norm, k_norm, s.qk_norm_eps, k_cache,
                             v_cache)
    except RuntimeError as e:  # the layers still run, one direct call at a time
        logger.warning("decode steps run the layers one by one: the C++ stack could not bind (%s)", e)
        return None
    return DecodeStack(native, first)

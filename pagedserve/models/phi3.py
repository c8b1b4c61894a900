"""Phi-3 / Phi-4-mini: the Llama decoder whose checkpoints store q|k|v and gate|up fused.

Our layers fuse the same projections, but shard them for tensor parallelism by head
and by half, so the checkpoint's fused tensors are split back into q, k, v and gate,
up at load and go through the usual per-shard loaders.  What else Phi-3 needs is in
shared layers: LongRoPE and the partial rotary dimension of Phi-4-mini
(layers/rotary_embedding.py) and the sliding window (a cap on max_model_len, as for
Mistral: model_loader/loader.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from pagedserve.models.llama import AttentionFlags, LlamaForCausalLM, head_dim_of


class Phi3ForCausalLM(LlamaForCausalLM):
    bias_flags = ()

    @classmethod
    def attention_flags(cls, config: Any) -> AttentionFlags:
        return dataclasses.replace(super().attention_flags(config), partial_rotary=True)

    def _split_fused(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        c = self.config
        head_dim = head_dim_of(c)
        q = c.num_attention_heads * head_dim
        kv = (getattr(c, "num_key_value_heads", None) or c.num_attention_heads) * head_dim
        for name, tensor in weights:
            if ".self_attn.qkv_proj." in name:
                if tensor.shape[0] != q + 2 * kv:
                    raise ValueError(f"checkpoint tensor {name!r}: {tensor.shape[0]} rows, expected q+k+v = "
                                     f"{q + 2 * kv}")
                # (narrow: a tensor-parallel rank's lazily read tensor has no split or chunk)
                pieces = (tensor.narrow(0, 0, q), tensor.narrow(0, q, kv), tensor.narrow(0, q + kv, kv))
                for part, piece in zip(("q_proj", "k_proj", "v_proj"), pieces, strict=True):
                    yield name.replace(".qkv_proj.", f".{part}."), piece
            elif ".mlp.gate_up_proj." in name:
                if tensor.shape[0] % 2:
                    raise ValueError(f"checkpoint tensor {name!r}: an odd number of rows cannot be gate|up")
                half = tensor.shape[0] // 2
                gate, up = tensor.narrow(0, 0, half), tensor.narrow(0, half, half)
                yield name.replace(".gate_up_proj.", ".gate_proj."), gate
                yield name.replace(".gate_up_proj.", ".up_proj."), up
            else:
                yield name, tensor

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self._split_fused(weights))

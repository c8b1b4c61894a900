"""Qwen3-MoE (Qwen3-30B-A3B and kin): Qwen3's attention, and on most layers a mixture of
experts instead of the dense MLP (layers/moe.py).

A layer is sparse unless it is in `mlp_only_layers` or off the `decoder_sparse_step`
grid, as in HF.  Checkpoints name experts one by one (`mlp.experts.{e}.gate_proj`, ...,
as published) or fused (`mlp.experts.gate_up_proj`, as transformers 5 keeps them in
memory); per-expert tensors are stacked into the fused layout while loading.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from pagedserve.layers.moe import SparseMoeBlock
from pagedserve.models.llama import LlamaMLP, check_swiglu
from pagedserve.models.qwen3 import Qwen3ForCausalLM

_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    @classmethod
    def make_mlp(cls, config: Any, layer: int) -> nn.Module:
        sparse = (layer not in (getattr(config, "mlp_only_layers", None) or [])
                  and config.num_experts > 0 and (layer + 1) % config.decoder_sparse_step == 0)
        if not sparse:
            return LlamaMLP(config)
        check_swiglu(config)  # (the experts' SiLU is fused into layers/moe.py)
        return SparseMoeBlock(config.hidden_size, config.num_experts, config.num_experts_per_tok,
                              config.moe_intermediate_size, bool(config.norm_topk_prob))

    def _stack_experts(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Per-expert tensors -> the fused [E, 2*I, H] and [E, H, I] of their layer, yielded
        as soon as the layer has all of them; everything else passes through."""
        num_experts = self.config.num_experts
        pending: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
        for name, tensor in weights:
            m = _EXPERT.fullmatch(name)
            if m is None:
                yield name, tensor
                continue
            prefix, expert, kind = m[1], int(m[2]), m[3]
            if expert >= num_experts:
                raise ValueError(f"checkpoint tensor {name!r}: expert {expert} of a model with {num_experts}")
            parts = pending.setdefault(prefix, {})
            parts[(expert, kind)] = tensor
            if len(parts) == 3 * num_experts:
                del pending[prefix]
                yield f"{prefix}.gate_up_proj", torch.stack(
                    [torch.cat([parts[(e, "gate_proj")], parts[(e, "up_proj")]]) for e in range(num_experts)])
                yield f"{prefix}.down_proj", torch.stack([parts[(e, "down_proj")] for e in range(num_experts)])
        for prefix, parts in pending.items():
            missing = [f"{prefix}.{e}.{k}.weight" for e in range(num_experts)
                       for k in ("gate_proj", "up_proj", "down_proj") if (e, k) not in parts]
            raise ValueError(f"checkpoint is missing {len(missing)} expert tensor(s): {', '.join(missing[:8])}")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self._stack_experts(weights))

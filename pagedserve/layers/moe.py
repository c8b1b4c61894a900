"""Mixture-of-experts MLP (Qwen3-MoE): a router picks top-k experts per token and only
those run.

Experts are stored as one fused tensor per layer, `gate_up_proj` [E, 2*I, H] and
`down_proj` [E, H, I] (transformers' own layout), so a layer is two parameters rather
than 3*E modules.  The CPU path runs only the selected experts: the (token, expert)
pairs are sorted by expert, and each expert with work multiplies just its tokens,
adding their weighted outputs back in expert order (the order HF adds them, so float32
outputs agree).  There is no dense all-experts matmul.

Tensor parallelism splits every expert along its intermediate dimension, like a dense
MLP: each rank holds rows [r*I/N, (r+1)*I/N) of gate and of up and the matching columns
of down, computes a partial output for every token, and the ranks sum them.

The dispatch loops over experts with data-dependent sizes, which torch.compile cannot
trace; it is a custom op (`pagedserve::moe_experts`) the compiled graph calls as a whole.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.distributed.communication import tensor_model_parallel_all_reduce
from pagedserve.layers.linear import default_weight_loader, get_tp_rank_size


@torch.library.custom_op("pagedserve::moe_experts", mutates_args=())
def moe_experts(x: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_k: int,
                renormalize: bool) -> torch.Tensor:
    """x [T, H] -> sum over each token's top-k experts of weight * expert(x)."""
    logits = F.linear(x, router)  # [T, E], in the model's dtype as HF computes it
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    weights = weights.to(x.dtype).flatten()
    flat = experts.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=router.shape[0]).tolist()
    out = torch.zeros_like(x)
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start:start + n]
        start += n
        tokens = pairs // top_k
        gate, up = F.linear(x[tokens], gate_up[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[expert])
        out.index_add_(0, tokens, y * weights[pairs, None])
    return out


@moe_experts.register_fake
def _(x: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_k: int,
      renormalize: bool) -> torch.Tensor:
    return torch.empty_like(x)


class Router(nn.Module):
    """The gate: one logit per expert (replicated on every tensor-parallel rank)."""

    def __init__(self, hidden_size: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)


class FusedExperts(nn.Module):
    """E SwiGLU experts as two tensors, each rank holding its slice of every expert."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank_size()
        if intermediate_size % self.tp_size:
            raise ValueError(f"moe_intermediate_size ({intermediate_size}) must be divisible by the tensor-parallel "
                             f"size ({self.tp_size})")
        self.intermediate = intermediate_size
        shard = intermediate_size // self.tp_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * shard, hidden_size), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, shard), requires_grad=False)
        self.gate_up_proj.weight_loader = self._load_gate_up
        self.down_proj.weight_loader = self._load_down

    def _rows(self) -> slice:
        shard = self.intermediate // self.tp_size
        return slice(self.tp_rank * shard, (self.tp_rank + 1) * shard)

    def _load_gate_up(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        """The checkpoint's whole [E, 2*I, H] (gate rows, then up rows): this rank's rows of each."""
        i = self.intermediate
        if loaded.dim() != 3 or loaded.shape[1] != 2 * i:
            raise ValueError(f"expected [experts, 2*{i}, hidden], got {list(loaded.shape)}")
        rows = self._rows()
        default_weight_loader(param, torch.cat([loaded[:, :i][:, rows], loaded[:, i:][:, rows]], dim=1), shard_id)

    def _load_down(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        if loaded.dim() != 3 or loaded.shape[2] != self.intermediate:
            raise ValueError(f"expected [experts, hidden, {self.intermediate}], got {list(loaded.shape)}")
        default_weight_loader(param, loaded[:, :, self._rows()], shard_id)


class SparseMoeBlock(nn.Module):
    """Router + experts; names follow the HF checkpoint (`mlp.gate`, `mlp.experts`)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 renormalize: bool) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok ({top_k}) must be between 1 and num_experts ({num_experts})")
        self.top_k = top_k
        self.renormalize = renormalize
        self.gate = Router(hidden_size, num_experts)
        self.experts = FusedExperts(num_experts, hidden_size, intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = moe_experts(x, self.gate.weight, self.experts.gate_up_proj, self.experts.down_proj, self.top_k,
                          self.renormalize)
        if self.experts.tp_size > 1:
            tensor_model_parallel_all_reduce(out)
        return out

"""Mixture-of-experts MLP (Qwen3-MoE): a router picks top-k experts per token and only
those run.

Experts are stored as one fused tensor per layer, `gate_up_proj` [E, 2*I, H] and
`down_proj` [E, H, I] (transformers' own layout), so a layer is two parameters rather
than 3*E modules.  The CPU path runs only the selected experts: the (token, expert)
pairs are sorted by expert, and each expert with work multiplies just its tokens,
adding their weighted outputs back in expert order (the order HF adds them, so float32
outputs agree).  There is no dense all-experts matmul.  Under weight quantization
("int8"/"int4") the experts are kept quantized and run by the quantized linear kernel
(the layers' own), whose rows do not depend on how many an expert gets: in bf16
oneDNN's products do, and answers then depended on batching.

Tensor parallelism splits every expert along its intermediate dimension, like a dense
MLP: each rank holds rows [r*I/N, (r+1)*I/N) of gate and of up and the matching columns
of down, computes a partial output for every token, and the ranks sum them.

The dispatch loops over experts with data-dependent sizes, which torch.compile cannot
trace; it is a custom op (`pagedserve::moe_experts`, `moe_experts_quantized`) the compiled
graph calls as a whole.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.distributed.communication import tensor_model_parallel_all_reduce
from pagedserve.layers.linear import default_weight_loader, get_tp_rank_size
from pagedserve.layers.quantization import (
    DEFAULT_ACTIVATION_BITS,
    as_block_weights,
    on_huge_pages,
    pack,
    quant_kernel,
)


def _route(x: torch.Tensor, router: torch.Tensor, top_k: int, renormalize: bool,
           expert: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """x [T, H] -> sum over each token's top-k experts of weight * expert(e, its rows):
    the routing both expert stores share (only the chosen experts run, each once over
    its tokens, their outputs added back in expert order: the order HF adds them)."""
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
    for e, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start:start + n]
        start += n
        tokens = pairs // top_k
        out.index_add_(0, tokens, expert(e, x[tokens]) * weights[pairs, None])
    return out


@torch.library.custom_op("pagedserve::moe_experts", mutates_args=())
def moe_experts(x: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_k: int,
                renormalize: bool) -> torch.Tensor:
    """x [T, H] -> the MoE block's output, experts in the model's dtype."""
    def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(rows, gate_up[e]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, down[e])

    return _route(x, router, top_k, renormalize, expert)


@moe_experts.register_fake
def _(x: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_k: int,
      renormalize: bool) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("pagedserve::moe_experts_quantized", mutates_args=())
def moe_experts_quantized(x: torch.Tensor, router: torch.Tensor, gate_up: list[torch.Tensor],
                          down: list[torch.Tensor], dims: list[int], top_k: int, renormalize: bool) -> torch.Tensor:
    """moe_experts over quantized experts (`StackedExperts.tensors()` of gate_up and down;
    dims: kind, gate_up's N and K, down's N and K, activation bits), by the quantized
    linear kernel, whose rows do not depend on how many an expert gets."""
    kernel = quant_kernel()
    kind, n_gu, k_gu, n_dn, k_dn, bits = dims

    def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
        gate, up = kernel.linear1(rows, gate_up[0][e], gate_up[1][e], gate_up[2][e], kind, n_gu, k_gu,
                                  bits).chunk(2, dim=-1)
        return kernel.linear1(F.silu(gate) * up, down[0][e], down[1][e], down[2][e], kind, n_dn, k_dn, bits)

    return _route(x, router, top_k, renormalize, expert)


@moe_experts_quantized.register_fake
def _(x: torch.Tensor, router: torch.Tensor, gate_up: list[torch.Tensor], down: list[torch.Tensor],
      dims: list[int], top_k: int, renormalize: bool) -> torch.Tensor:
    return torch.empty_like(x)


@dataclass
class StackedExperts:
    """E experts' quantized [n, k] weights (one shape and kind), their packed layouts
    stacked along a first dimension: the kernel reads expert e's slices."""

    kind: int
    n: int
    k: int
    codes: torch.Tensor
    d: torch.Tensor
    aux: torch.Tensor

    @classmethod
    def quantize(cls, w: torch.Tensor, method: str) -> StackedExperts:
        """From float [E, n, k] (this rank's rows of each expert), quantized by `method`."""
        packed = [pack(as_block_weights(w[e], method)) for e in range(w.shape[0])]
        first = packed[0]
        return cls(int(first.kind), first.n, first.k, *(on_huge_pages(torch.stack([getattr(p, f) for p in packed]))
                                                       for f in ("codes", "d", "aux")))

    def tensors(self) -> list[torch.Tensor]:
        return [self.codes, self.d, self.aux]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


class Router(nn.Module):
    """The gate: one logit per expert (replicated on every tensor-parallel rank)."""

    def __init__(self, hidden_size: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)


class FusedExperts(nn.Module):
    """E SwiGLU experts as two tensors, each rank holding its slice of every expert; under
    weight quantization ("int8"/"int4") each kept quantized instead (StackedExperts), the
    float tensors then empty placeholders."""

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
        self.quant_method: str | None = None
        self.activation_bits = DEFAULT_ACTIVATION_BITS
        self.quantized: dict[str, StackedExperts] = {}  # "gate_up" and "down", once loaded quantized

    def enable_quantization(self, method: str, activation_bits: int = DEFAULT_ACTIVATION_BITS,
                            now: bool = False) -> None:
        """Keep the experts quantized by `method` as their tensors load (`now`: the values
        they hold, random weights)."""
        self.quant_method, self.activation_bits = method, activation_bits
        if now:
            for param in (self.gate_up_proj, self.down_proj):
                self._store(param, param.data)

    def _store(self, param: nn.Parameter, w: torch.Tensor) -> None:
        """This rank's [E, n, k] of `param`: quantized (the float placeholder left [E, n, 0])
        or copied in."""
        if self.quant_method is None:
            default_weight_loader(param, w)
            return
        if tuple(w.shape) != (param.shape[0], param.shape[1], self.logical_k(param)):
            raise ValueError(f"expected {[param.shape[0], param.shape[1], self.logical_k(param)]}, "
                             f"got {list(w.shape)}")
        self.quantized["gate_up" if param is self.gate_up_proj else "down"] = \
            StackedExperts.quantize(w, self.quant_method)
        param.data = torch.empty(param.shape[0], param.shape[1], 0, dtype=param.dtype, device=param.device)

    def logical_k(self, param: nn.Parameter) -> int:
        """The experts' input width of `param` (a quantized placeholder holds none)."""
        return self.down_proj.shape[1] if param is self.gate_up_proj else self.intermediate // self.tp_size

    def _rows(self, loaded: torch.Tensor, dim: int, offset: int = 0) -> torch.Tensor:
        """This rank's rows of every expert along `dim` (from `offset`), by narrow: a tensor-
        parallel rank's lazily read tensor takes no indexing."""
        shard = self.intermediate // self.tp_size
        return loaded.narrow(dim, offset + self.tp_rank * shard, shard)

    def _load_gate_up(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        """The checkpoint's whole [E, 2*I, H] (gate rows, then up rows): this rank's rows of each."""
        i = self.intermediate
        if loaded.dim() != 3 or loaded.shape[1] != 2 * i:
            raise ValueError(f"expected [experts, 2*{i}, hidden], got {list(loaded.shape)}")
        if shard_id is not None:
            raise ValueError(f"unexpected shard {shard_id!r} for the experts' gate_up_proj")
        self._store(param, torch.cat([self._rows(loaded, 1), self._rows(loaded, 1, i)], dim=1))

    def _load_down(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        if loaded.dim() != 3 or loaded.shape[2] != self.intermediate:
            raise ValueError(f"expected [experts, hidden, {self.intermediate}], got {list(loaded.shape)}")
        if shard_id is not None:
            raise ValueError(f"unexpected shard {shard_id!r} for the experts' down_proj")
        self._store(param, self._rows(loaded, 2))

    def nbytes_quantized(self) -> int:
        return sum(q.nbytes() for q in self.quantized.values())

    def forward(self, x: torch.Tensor, router: torch.Tensor, top_k: int, renormalize: bool) -> torch.Tensor:
        if not self.quantized:
            return moe_experts(x, router, self.gate_up_proj, self.down_proj, top_k, renormalize)
        gu, dn = self.quantized["gate_up"], self.quantized["down"]
        return moe_experts_quantized(x, router, gu.tensors(), dn.tensors(),
                                     [gu.kind, gu.n, gu.k, dn.n, dn.k, self.activation_bits], top_k, renormalize)


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
        out = self.experts(x, self.gate.weight, self.top_k, self.renormalize)
        if self.experts.tp_size > 1:
            tensor_model_parallel_all_reduce(out)
        return out

"""The mixture-of-experts block: routing, that only the chosen experts run, tensor-parallel
slices that sum to the whole, and both checkpoint layouts of the experts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import pagedserve.layers.moe as moe
from pagedserve.layers.moe import SparseMoeBlock


def block(num_experts: int = 6, top_k: int = 2, hidden: int = 16, inter: int = 12, renorm: bool = True,
          seed: int = 0) -> tuple[SparseMoeBlock, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    w = {"router": torch.randn(num_experts, hidden, generator=g),
         "gate_up": torch.randn(num_experts, 2 * inter, hidden, generator=g) * 0.3,
         "down": torch.randn(num_experts, hidden, inter, generator=g) * 0.3}
    b = SparseMoeBlock(hidden, num_experts, top_k, inter, renorm)
    b.gate.weight.data.copy_(w["router"])
    b.experts.gate_up_proj.weight_loader(b.experts.gate_up_proj, w["gate_up"])
    b.experts.down_proj.weight_loader(b.experts.down_proj, w["down"])
    return b, w


def reference(x: torch.Tensor, w: dict[str, torch.Tensor], top_k: int, renorm: bool) -> torch.Tensor:
    """Every expert on every token, weighted by the router's renormalised top-k (dense, for checking)."""
    probs = torch.softmax(x @ w["router"].T, dim=-1)
    top, idx = probs.topk(top_k, dim=-1)
    if renorm:
        top = top / top.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for e in range(w["router"].shape[0]):
        gate, up = (x @ w["gate_up"][e].T).chunk(2, dim=-1)
        y = (F.silu(gate) * up) @ w["down"][e].T
        weight = (top * (idx == e)).sum(-1, keepdim=True)
        out += weight * y
    return out


@pytest.mark.parametrize("renorm", [True, False])
def test_top_k_routing_matches_a_dense_reference(renorm: bool) -> None:
    b, w = block(renorm=renorm)
    x = torch.randn(9, 16, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(b(x), reference(x, w, 2, renorm), atol=1e-5, rtol=1e-5)


def test_only_the_chosen_experts_run() -> None:
    b, w = block(top_k=1)
    with torch.no_grad():
        b.gate.weight.zero_()
        b.gate.weight[3, 0] = 50.0  # every token with x[0] > 0 picks expert 3
        for e in range(6):
            if e != 3:
                b.experts.gate_up_proj[e] = float("nan")  # any other expert that ran would poison the output
    x = torch.randn(7, 16).abs()
    out = b(x)
    gate, up = (x @ w["gate_up"][3].T).chunk(2, dim=-1)
    torch.testing.assert_close(out, (F.silu(gate) * up) @ w["down"][3].T)


def test_tensor_parallel_slices_sum_to_the_whole(monkeypatch) -> None:
    full, w = block()
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(2))
    partial = torch.zeros_like(x)
    for rank in range(2):
        monkeypatch.setattr(moe, "get_tp_rank_size", lambda r=rank: (r, 2))
        shard = SparseMoeBlock(16, 6, 2, 12, True)
        assert shard.experts.gate_up_proj.shape == (6, 12, 16) and shard.experts.down_proj.shape == (6, 16, 6)
        shard.gate.weight.data.copy_(w["router"])
        shard.experts.gate_up_proj.weight_loader(shard.experts.gate_up_proj, w["gate_up"])
        shard.experts.down_proj.weight_loader(shard.experts.down_proj, w["down"])
        partial += moe.moe_experts(x, shard.gate.weight, shard.experts.gate_up_proj, shard.experts.down_proj, 2, True)
    torch.testing.assert_close(partial, full(x), atol=1e-5, rtol=1e-5)
    monkeypatch.setattr(moe, "get_tp_rank_size", lambda: (0, 5))
    with pytest.raises(ValueError, match="moe_intermediate_size \\(12\\) must be divisible"):
        SparseMoeBlock(16, 6, 2, 12, True)


def test_bad_shapes_and_top_k_are_refused() -> None:
    b, w = block()
    with pytest.raises(ValueError, match=r"expected \[experts, 2\*12, hidden\]"):
        b.experts.gate_up_proj.weight_loader(b.experts.gate_up_proj, w["gate_up"][:, :20])
    with pytest.raises(ValueError, match="num_experts_per_tok \\(7\\) must be between 1 and num_experts \\(6\\)"):
        SparseMoeBlock(16, 6, 7, 12, True)


def test_per_expert_and_fused_checkpoints_load_the_same(tmp_path) -> None:
    """Published Qwen3-MoE checkpoints name experts one by one; transformers 5 keeps them
    fused: both layouts give the same model, and a missing expert is named."""
    from safetensors.torch import load_file, save_file

    from pagedserve.config import ModelConfig
    from pagedserve.model_loader import get_model
    from tests.e2e.conftest import make_tiny_checkpoint
    from tests.models.models_helpers import our_logits

    make_tiny_checkpoint("qwen3_moe", str(tmp_path))
    per_expert = load_file(tmp_path / "model.safetensors")
    ids = torch.arange(12)
    want = our_logits(get_model(ModelConfig(model=str(tmp_path), dtype="float32"), "cpu"), ids)
    fused = {k: v for k, v in per_expert.items() if ".mlp.experts." not in k}
    prefix = "model.layers.0.mlp.experts"
    fused[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([per_expert[f"{prefix}.{e}.gate_proj.weight"],
                                                              per_expert[f"{prefix}.{e}.up_proj.weight"]])
                                                   for e in range(8)])
    fused[f"{prefix}.down_proj"] = torch.stack([per_expert[f"{prefix}.{e}.down_proj.weight"] for e in range(8)])
    save_file(fused, tmp_path / "model.safetensors")
    torch.testing.assert_close(our_logits(get_model(ModelConfig(model=str(tmp_path), dtype="float32"), "cpu"), ids),
                               want, rtol=0, atol=0)
    del per_expert[f"{prefix}.5.up_proj.weight"]
    save_file(per_expert, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing 1 expert tensor\(s\): model.layers.0.mlp.experts.5.up_proj"):
        get_model(ModelConfig(model=str(tmp_path), dtype="float32"), "cpu")


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_experts_match_their_dequantized_weights_and_rows_stand_alone(method) -> None:
    """Under weight quantization the experts are kept quantized and run by the quantized
    kernel: the output is the dense reference's over the dequantized weights, and a token's
    row is bit for bit the same whatever else the call holds (in bfloat16 the experts'
    oneDNN products rounded by how many tokens an expert got, so answers depended on
    batching)."""
    from pagedserve.layers.quantization import quantize

    b, w = block(hidden=64, inter=48, seed=3)
    b.experts.enable_quantization(method, now=True)
    assert b.experts.gate_up_proj.numel() == 0 and set(b.experts.quantized) == {"gate_up", "down"}
    deq = {"router": w["router"],
           **{k: torch.stack([quantize(t, method).dequantize()[:, : t.shape[1]] for t in w[k]]) for k in ("gate_up", "down")}}
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(b(x), reference(x, deq, 2, True), rtol=2e-3, atol=2e-3)
    # Qwen3-30B-A3B's expert shapes in bfloat16: in the model's dtype 8 of these 24 rows came
    # out otherwise alone than among the others (oneDNN, Zen 5); quantized, none does.
    big = SparseMoeBlock(2048, 4, 2, 768, True)
    g = torch.Generator().manual_seed(0)
    for p in (big.gate.weight, big.experts.gate_up_proj, big.experts.down_proj):
        p.data = (torch.randn(p.shape, generator=g) * 0.02).bfloat16()
    big.experts.enable_quantization(method, now=True)
    xb = torch.randn(24, 2048, generator=g).bfloat16()
    whole = big(xb)
    assert whole.dtype == torch.bfloat16
    for i in range(len(xb)):
        assert torch.equal(big(xb[i:i + 1])[0], whole[i]), i
    assert torch.equal(big(xb[[2, 7, 4]]), whole[[2, 7, 4]])


def test_a_quantized_moe_checkpoint_loads_its_experts_quantized(tmp_path, caplog) -> None:
    """quantization int8 covers the experts too (they stayed in the model's dtype: a MoE's
    largest weights, and the batching dependence above); the load says so."""
    import logging

    from pagedserve.config import ModelConfig
    from pagedserve.layers.moe import FusedExperts
    from pagedserve.model_loader import get_model
    from tests.e2e.conftest import make_tiny_checkpoint
    from tests.models.models_helpers import our_logits

    make_tiny_checkpoint("qwen3_moe", str(tmp_path))
    ids = torch.arange(12)
    want = our_logits(get_model(ModelConfig(model=str(tmp_path), dtype="float32"), "cpu"), ids)
    with caplog.at_level(logging.INFO, logger="pagedserve"):
        model = get_model(ModelConfig(model=str(tmp_path), dtype="float32", quantization="int8"), "cpu")
    experts = [m for m in model.modules() if isinstance(m, FusedExperts)]
    assert experts and all(set(m.quantized) == {"gate_up", "down"} for m in experts)
    assert "mixture-of-experts experts quantized too" in caplog.text
    got = our_logits(model, ids)
    assert (got - want).abs().max() < 0.05 * want.abs().max()  # (int8 weights: close, not equal)

"""In-process checks of how a rank shards the model, and of the up-front errors.

Building a model inside `tp_group_scope(TPGroup(rank, 2))` needs no other process:
loading is local, only forward passes communicate.  So each rank's parameters can be
compared with slices of the unsharded model directly.
"""

from __future__ import annotations

import argparse
import multiprocessing
import time
from types import SimpleNamespace

import pytest
import torch

from pagedserve import LLM
from pagedserve.config import EngineConfig, ModelConfig, ParallelConfig
from pagedserve.distributed.parallel_state import TPGroup, get_tp_group, tp_group_scope
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.executor.multiproc_executor import validate_tensor_parallel
from pagedserve.model_loader import get_model, load_model_config
from pagedserve.model_loader.weight_utils import LazySlice


def _load(path: str, group: TPGroup) -> dict[str, torch.Tensor]:
    mc = ModelConfig(model=path, dtype="float32")
    load_model_config(mc, "cpu")
    with tp_group_scope(group):
        model = get_model(mc, "cpu")
    return dict(model.named_parameters())


@pytest.mark.parametrize("arch,kv", [("llama", 2), ("qwen3", 1)])
def test_each_rank_holds_its_shard(tp_checkpoint, arch: str, kv: int) -> None:
    path = tp_checkpoint(arch, kv)
    full = _load(path, TPGroup())
    layer = "model.layers.1."
    hd = full[layer + "self_attn.o_proj.weight"].shape[1] // 4  # 4 query heads
    q_full = 4 * hd
    for rank in range(2):
        part = _load(path, TPGroup(rank, 2, "gloo"))
        assert get_tp_group() == TPGroup()  # the scope does not outlive the build
        qkv, fqkv = part[layer + "self_attn.qkv_proj.weight"], full[layer + "self_attn.qkv_proj.weight"]
        kv_local = 1 if kv == 1 else kv // 2
        assert qkv.shape[0] == (2 + 2 * kv_local) * hd
        torch.testing.assert_close(qkv[: 2 * hd], fqkv[rank * 2 * hd:(rank + 1) * 2 * hd], rtol=0, atol=0)
        kv_head = rank if kv == 2 else 0  # one KV head: replicated on both ranks
        for j, off in enumerate((q_full, q_full + kv * hd)):  # k, then v
            got = qkv[2 * hd + j * kv_local * hd: 2 * hd + (j + 1) * kv_local * hd]
            torch.testing.assert_close(got, fqkv[off + kv_head * hd: off + (kv_head + 1) * hd], rtol=0, atol=0)
        o, fo = part[layer + "self_attn.o_proj.weight"], full[layer + "self_attn.o_proj.weight"]
        torch.testing.assert_close(o, fo[:, rank * 2 * hd:(rank + 1) * 2 * hd], rtol=0, atol=0)
        gu, fgu = part[layer + "mlp.gate_up_proj.weight"], full[layer + "mlp.gate_up_proj.weight"]
        torch.testing.assert_close(gu[:64], fgu[rank * 64:(rank + 1) * 64], rtol=0, atol=0)  # gate half
        torch.testing.assert_close(gu[64:], fgu[128 + rank * 64:128 + (rank + 1) * 64], rtol=0, atol=0)
        down, fdown = part[layer + "mlp.down_proj.weight"], full[layer + "mlp.down_proj.weight"]
        torch.testing.assert_close(down, fdown[:, rank * 64:(rank + 1) * 64], rtol=0, atol=0)
        torch.testing.assert_close(part["model.norm.weight"], full["model.norm.weight"], rtol=0, atol=0)
        # vocab 509 over 2 ranks: 255 rows each, the last one zero padding on rank 1
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            w = part[name]
            assert w.shape == (255, 64)
            valid = 255 if rank == 0 else 254
            torch.testing.assert_close(w[:valid], full[name][rank * 255: rank * 255 + valid], rtol=0, atol=0)
            assert not w[valid:].any()


def test_a_moe_rank_reads_its_slice_of_every_expert(tmp_path) -> None:
    """Qwen3-MoE's per-expert tensors, read lazily by a rank and stacked (torch.cat of
    LazySlices recursed until the stack overflowed: tensor parallelism could not load a
    published MoE checkpoint), and the fused layout's (indexing a lazy tensor failed):
    each rank holds its rows of each expert, quantized too."""
    from tests.e2e.conftest import make_tiny_checkpoint

    make_tiny_checkpoint("qwen3_moe", str(tmp_path))
    full = _load(str(tmp_path), TPGroup())
    name = "model.layers.0.mlp.experts."
    gu, down = full[name + "gate_up_proj"], full[name + "down_proj"]
    inter = down.shape[2]
    for rank in range(2):
        part = _load(str(tmp_path), TPGroup(rank, 2, "gloo"))
        rows = slice(rank * inter // 2, (rank + 1) * inter // 2)
        torch.testing.assert_close(part[name + "gate_up_proj"],
                                   torch.cat([gu[:, :inter][:, rows], gu[:, inter:][:, rows]], dim=1), rtol=0, atol=0)
        torch.testing.assert_close(part[name + "down_proj"], down[:, :, rows], rtol=0, atol=0)
    # transformers 5's fused layout (the experts of a layer in two tensors), read lazily too
    from safetensors.torch import load_file, save_file

    tensors = load_file(tmp_path / "model.safetensors")
    layers = {k.split(".mlp.experts.")[0] for k in tensors if ".mlp.experts." in k}
    for layer in layers:
        p, num = f"{layer}.mlp.experts", len({k for k in tensors if k.startswith(f"{layer}.mlp.experts.")}) // 3
        tensors[f"{p}.gate_up_proj"] = torch.stack([torch.cat([tensors.pop(f"{p}.{e}.gate_proj.weight"),
                                                               tensors.pop(f"{p}.{e}.up_proj.weight")]) for e in range(num)])
        tensors[f"{p}.down_proj"] = torch.stack([tensors.pop(f"{p}.{e}.down_proj.weight") for e in range(num)])
    save_file(tensors, tmp_path / "model.safetensors")
    part = _load(str(tmp_path), TPGroup(1, 2, "gloo"))
    torch.testing.assert_close(part[name + "down_proj"], down[:, :, inter // 2:], rtol=0, atol=0)
    mc = ModelConfig(model=str(tmp_path), dtype="float32", quantization="int8")
    load_model_config(mc, "cpu")
    with tp_group_scope(TPGroup(1, 2, "gloo")):
        experts = get_model(mc, "cpu").model.layers[0].mlp.experts
    assert experts.quantized["down"].k == -(-inter // 2 // 32) * 32 and experts.quantized["down"].n == down.shape[1]


def test_a_phi3_rank_splits_its_fused_tensors(tmp_path) -> None:
    """Phi-3's checkpoint fuses q|k|v and gate|up; a rank reads them lazily, and splitting
    them called methods a lazy slice lacks (tensor parallelism could not load Phi-3)."""
    from tests.e2e.conftest import make_tiny_checkpoint

    make_tiny_checkpoint("phi3", str(tmp_path))
    full = _load(str(tmp_path), TPGroup())
    name = "model.layers.0.mlp.down_proj.weight"
    inter = full[name].shape[1]
    for rank in range(2):
        part = _load(str(tmp_path), TPGroup(rank, 2, "gloo"))
        torch.testing.assert_close(part[name], full[name][:, rank * inter // 2:(rank + 1) * inter // 2],
                                   rtol=0, atol=0)
        gu, fgu = part["model.layers.0.mlp.gate_up_proj.weight"], full["model.layers.0.mlp.gate_up_proj.weight"]
        half = inter // 2
        torch.testing.assert_close(gu[:half], fgu[rank * half:(rank + 1) * half], rtol=0, atol=0)


def test_lazy_slice_reads_only_what_it_is_asked(tmp_path) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    w = torch.arange(24.0).view(4, 6)
    save_file({"w": w}, str(tmp_path / "t.safetensors"))
    lazy = LazySlice(safe_open(str(tmp_path / "t.safetensors"), "pt"), "w", "t.safetensors")
    assert lazy.shape == (4, 6) and lazy.dim() == 2 and lazy.size(1) == 6
    torch.testing.assert_close(lazy.narrow(1, 2, 3), w[:, 2:5])
    torch.testing.assert_close(lazy.narrow(0, 3, 1), w[3:])
    dst = torch.zeros(4, 6)
    dst.copy_(lazy)  # any other torch use reads the whole tensor
    torch.testing.assert_close(dst, w)


def _config(heads: int, kv: int, tp: int, inter: int = 128, backend: str | None = None) -> EngineConfig:
    hf = SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv, intermediate_size=inter)
    return EngineConfig(model_config=ModelConfig(model="m", hf_config=hf),
                        parallel_config=ParallelConfig(tensor_parallel_size=tp, distributed_backend=backend))


def test_validate_rejects_impossible_splits(monkeypatch) -> None:
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 .* num_attention_heads=9; valid sizes: 1, 3"):
        validate_tensor_parallel(_config(9, 3, 2, inter=1536), cpu)  # SmolLM2-135M
    with pytest.raises(ValueError, match="num_key_value_heads=3 is neither a multiple nor a divisor"):
        validate_tensor_parallel(_config(12, 3, 2), cpu)
    with pytest.raises(ValueError, match="intermediate_size=129"):
        validate_tensor_parallel(_config(4, 4, 2, inter=129), cpu)
    with pytest.raises(ValueError, match="positive integer"):
        validate_tensor_parallel(_config(4, 4, 0), cpu)
    with pytest.raises(ValueError, match="'nccl' needs CUDA"):
        validate_tensor_parallel(_config(4, 4, 2, backend="nccl"), cpu)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"needs 2 GPUs from cuda:0, but 1 is visible"):
        validate_tensor_parallel(_config(4, 4, 2), torch.device("cuda"))
    validate_tensor_parallel(_config(4, 1, 4), cpu)  # KV heads replicated: fine
    validate_tensor_parallel(_config(4, 4, 1), torch.device("cuda"))


def test_llm_rejects_bad_tp_before_starting_a_process(tp_checkpoint) -> None:
    path = tp_checkpoint("llama", 2)
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="tensor_parallel_size=3 cannot split .*num_attention_heads=4"):
        LLM(path, dtype="float32", device="cpu", tensor_parallel_size=3)
    for bad in (0, -1):
        with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
            LLM(path, dtype="float32", device="cpu", tensor_parallel_size=bad)
    assert multiprocessing.active_children() == []
    assert time.monotonic() - t0 < 5


def test_cli_short_flag() -> None:
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert EngineArgs.from_cli_args(parser.parse_args(["-tp", "2"])).tensor_parallel_size == 2
    assert EngineArgs.from_cli_args(parser.parse_args(["--tensor-parallel-size", "4"])).tensor_parallel_size == 4

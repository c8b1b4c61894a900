"""KV cache sizing by profiling on CUDA (the arithmetic and messages, checked on CPU
with the device's memory figures stubbed) and the profile run itself."""

from __future__ import annotations

import pytest
import torch
from worker_helpers import ToyModel, toy_config

from pagedserve.config import CacheConfig
from pagedserve.worker import kv_cache
from pagedserve.worker.kv_cache import determine_num_blocks, gpu_kv_budget
from pagedserve.worker.model_runner import ModelRunner

GiB = 2**30
CUDA = torch.device("cuda")  # only named: the memory query is stubbed


def test_gpu_budget_is_a_share_of_total_less_weights_and_activations():
    assert gpu_kv_budget(80 * GiB, 78 * GiB, 2 * GiB, 1 * GiB, 0.9) == int(72 * GiB) - 3 * GiB
    # Another process holds 60 GiB: what is free, less activations, bounds the cache.
    assert gpu_kv_budget(80 * GiB, 18 * GiB, 2 * GiB, 1 * GiB, 0.9) == 17 * GiB
    assert gpu_kv_budget(80 * GiB, 78 * GiB, 2 * GiB, 1 * GiB, 0.02) < 0


def _stub(monkeypatch, free, total, weights):
    monkeypatch.setattr(kv_cache, "cuda_memory_info", lambda device: (free, total, weights))


def test_cuda_num_blocks(monkeypatch):
    _stub(monkeypatch, free=70 * GiB, total=80 * GiB, weights=2 * GiB)
    cfg = CacheConfig(block_size=16, gpu_memory_utilization=0.5)
    block = 1 << 20
    expect = (40 * GiB - 2 * GiB - GiB // 2) // block
    assert determine_num_blocks(cfg, block, 4096, 10_000, CUDA, reserved_bytes=GiB // 2)[0] == expect
    # Capped at what max_num_seqs requests of max_model_len can use (plus the null block).
    assert determine_num_blocks(cfg, block, 4096, 4, CUDA, reserved_bytes=GiB // 2)[0] == 4 * 256 + 1


def test_cuda_too_small_names_both_knobs(monkeypatch):
    _stub(monkeypatch, free=70 * GiB, total=80 * GiB, weights=2 * GiB)
    cfg = CacheConfig(block_size=16, gpu_memory_utilization=0.03)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.03 of 80.0 GiB total memory, less 2.00 GiB "
                                         r"of weights and 0.25 GiB of peak activations.*max_model_len=32768 needs "
                                         r"2048; raise gpu_memory_utilization or lower max_model_len"):
        determine_num_blocks(cfg, 1 << 20, 32768, 8, CUDA, reserved_bytes=GiB // 4)
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        determine_num_blocks(CacheConfig(gpu_memory_utilization=0), 1 << 20, 64, 8, CUDA)


def test_explicit_sizes_skip_profiling(monkeypatch):
    _stub(monkeypatch, free=1, total=1, weights=1)  # would fail if consulted
    assert determine_num_blocks(CacheConfig(kv_cache_memory_bytes=64 << 20), 1 << 20, 64, 8, CUDA)[0] == 64
    assert determine_num_blocks(CacheConfig(num_blocks=33), 1 << 20, 64, 8, CUDA)[0] == 33


def test_profile_run_covers_the_whole_token_budget_and_the_sampler():
    config = toy_config(max_model_len=256, max_num_batched_tokens=600, max_num_seqs=8, kv_cache_memory_bytes=1 << 20)
    model = ToyModel().eval()
    runner = ModelRunner(config, model)
    seen = {}
    forward, sampler = model.forward, runner.sampler

    def spy_forward(ids, pos):
        seen["tokens"], seen["max_pos"] = ids.numel(), int(pos.max())
        return forward(ids, pos)

    def spy_sampler(logits, md):
        seen["rows"], seen["top_p"] = logits.shape[0], md.top_p is not None
        return sampler(logits, md)

    model.forward, runner.sampler = spy_forward, spy_sampler
    assert runner.profile_run() == 0  # CPU: nothing to measure
    assert seen == {"tokens": 600, "max_pos": 255, "rows": 8, "top_p": True}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_profile_sizes_the_cache_from_total_memory():
    config = toy_config(max_model_len=1024, max_num_batched_tokens=2048, max_num_seqs=4096)
    runner = ModelRunner(config, ToyModel().eval().cuda(), device="cuda")
    assert runner.profile_run() > 0
    free, total, weights = kv_cache.cuda_memory_info(runner.device)
    config.cache_config.gpu_memory_utilization = (weights + (256 << 20)) / total  # ~256 MiB left for the cache
    num_blocks = runner.initialize_kv_cache()
    block = kv_cache.bytes_per_block(runner.attn_layers, runner.block_size, runner.dtype)
    assert 0 < num_blocks * block < 256 << 20  # less the activations, which the profile measured
    assert num_blocks * block > (256 << 20) - 8 * runner.profile_run() - (64 << 20)

"""KV cache sizing: explicit bytes, a fraction of free memory, the cap, clear errors."""

from __future__ import annotations

import pytest
import torch

from pagedserve.config import CacheConfig
from pagedserve.worker import kv_cache
from pagedserve.worker.kv_cache import determine_num_blocks

CPU = torch.device("cpu")
BLOCK_BYTES = 1000


def test_explicit_bytes():
    cfg = CacheConfig(block_size=16, kv_cache_memory_bytes=100_500)
    assert determine_num_blocks(cfg, BLOCK_BYTES, max_model_len=64, max_num_seqs=4, device=CPU)[0] == 100


def test_explicit_bytes_past_available_memory_are_taken_with_a_warning(monkeypatch, caplog):
    """The cache is mapped as it fills: 100 GiB on a 21 GiB machine started, silently, and
    a busy server would be killed for memory."""
    import logging

    monkeypatch.setattr(kv_cache, "available_memory_bytes", lambda device: 50_000)
    with caplog.at_level(logging.WARNING, logger="pagedserve"):
        assert determine_num_blocks(CacheConfig(block_size=16, kv_cache_memory_bytes=100_500), BLOCK_BYTES,
                                    max_model_len=64, max_num_seqs=4, device=CPU)[0] == 100
    assert "kv_cache_memory_bytes=100500 is more than the 0.0 GiB of memory available now" in caplog.text
    caplog.clear()
    determine_num_blocks(CacheConfig(block_size=16, kv_cache_memory_bytes=40_000), BLOCK_BYTES, 64, 4, CPU)
    assert "available now" not in caplog.text


def test_explicit_num_blocks_wins():
    cfg = CacheConfig(block_size=16, kv_cache_memory_bytes=10**9, num_blocks=9)
    assert determine_num_blocks(cfg, BLOCK_BYTES, 64, 4, CPU)[0] == 9


def test_fraction_of_free_memory_capped_at_useful_size(monkeypatch):
    monkeypatch.setattr(kv_cache, "available_memory_bytes", lambda device: 4_000_000)
    cfg = CacheConfig(block_size=16, cpu_kv_cache_fraction=0.25)
    num_blocks, why = determine_num_blocks(cfg, BLOCK_BYTES, 64, 1000, CPU)
    assert num_blocks == 1000
    assert why.startswith("cpu_kv_cache_fraction=0.25 of 0.0 GiB available memory, less than the max_num_seqs=1000")
    # 2 requests of 4 blocks can never use more than 8 blocks (+ the null block).
    num_blocks, why = determine_num_blocks(cfg, BLOCK_BYTES, 64, 2, CPU)
    assert num_blocks == 9 and why.startswith("max_num_seqs=2 x max_model_len=64 could use")


def test_cpu_kv_cache_space_replaces_the_fraction_and_is_still_capped(monkeypatch):
    from pagedserve.engine.arg_utils import EngineArgs

    monkeypatch.setattr(kv_cache, "available_memory_bytes", lambda device: 10**12)
    monkeypatch.setenv("PAGEDSERVE_CPU_KV_CACHE_SPACE", "10KiB")
    cache = EngineArgs().create_engine_config(load_hf_config=False).cache_config
    assert cache.cpu_kv_cache_space == 10 * 1024
    num_blocks, why = determine_num_blocks(cache, BLOCK_BYTES, 64, 1000, CPU)
    assert num_blocks == 10 * 1024 // BLOCK_BYTES and why.startswith("cpu_kv_cache_space=0.00 GiB")
    num_blocks, why = determine_num_blocks(cache, BLOCK_BYTES, 16, 1, CPU)  # one block of need, plus null
    assert num_blocks == 2 and why.startswith("max_num_seqs=1 x max_model_len=16 could use")
    monkeypatch.setenv("PAGEDSERVE_CPU_KV_CACHE_SPACE", "lots")
    with pytest.raises(ValueError, match="PAGEDSERVE_CPU_KV_CACHE_SPACE"):
        EngineArgs().create_engine_config(load_hf_config=False)
    monkeypatch.delenv("PAGEDSERVE_CPU_KV_CACHE_SPACE")
    assert EngineArgs().create_engine_config(load_hf_config=False).cache_config.cpu_kv_cache_space is None
    # vLLM's variable, GiB as a number (0: unset), read where ours is unset: a vLLM operator's cap holds.
    for value, want in (("2", 2 * 2**30), ("0.5", 2**29), ("0", None)):
        monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", value)
        assert EngineArgs().create_engine_config(load_hf_config=False).cache_config.cpu_kv_cache_space == want
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "40GB")
    with pytest.raises(ValueError, match="VLLM_CPU_KVCACHE_SPACE must be a number of GiB"):
        EngineArgs().create_engine_config(load_hf_config=False)
    monkeypatch.setenv("PAGEDSERVE_CPU_KV_CACHE_SPACE", "10KiB")  # ours wins
    assert EngineArgs().create_engine_config(load_hf_config=False).cache_config.cpu_kv_cache_space == 10 * 1024


def test_a_ceiling_replaces_the_share_of_free_memory_and_is_still_capped_at_need(monkeypatch):
    """(A served model's share of --max-models-memory: given as the size, a 20 GiB share
    filled page by page under traffic where 2.25 GiB was all its requests could use.)"""
    monkeypatch.setattr(kv_cache, "available_memory_bytes", lambda device: 10**12)
    cfg = CacheConfig(block_size=16, kv_cache_memory_ceiling=10_500)
    num_blocks, why = determine_num_blocks(cfg, BLOCK_BYTES, 64, 1000, CPU)
    assert num_blocks == 10 and why.startswith("kv_cache_memory_ceiling=10500, less than the max_num_seqs=1000")
    num_blocks, why = determine_num_blocks(cfg, BLOCK_BYTES, 64, 2, CPU)  # 2 x 4 blocks, plus null
    assert num_blocks == 9 and why.startswith("max_num_seqs=2 x max_model_len=64 could use")


def test_too_small_names_the_knobs(monkeypatch):
    cfg = CacheConfig(block_size=16, kv_cache_memory_bytes=3_500)
    with pytest.raises(ValueError, match=r"kv_cache_memory_bytes=3500 gives 2 usable blocks.*"
                                         r"max_model_len=64 needs 4.*raise kv_cache_memory_bytes or lower max_model_len"):
        determine_num_blocks(cfg, BLOCK_BYTES, 64, 4, CPU)
    monkeypatch.setattr(kv_cache, "available_memory_bytes", lambda device: 1000)
    with pytest.raises(ValueError, match="cpu_kv_cache_fraction=0.25 of .* available memory"):
        determine_num_blocks(CacheConfig(block_size=16), BLOCK_BYTES, 64, 4, CPU)
    with pytest.raises(ValueError, match="cpu_kv_cache_fraction must be in"):
        determine_num_blocks(CacheConfig(cpu_kv_cache_fraction=1.5), BLOCK_BYTES, 64, 4, CPU)
    with pytest.raises(ValueError, match="kv_cache_memory_bytes must be positive"):
        determine_num_blocks(CacheConfig(kv_cache_memory_bytes=0), BLOCK_BYTES, 64, 4, CPU)


def test_cpu_kv_cache_pages_are_mapped_on_first_touch_not_at_start() -> None:
    """A default `serve` sizes the cache for max_num_seqs x max_model_len: the memory it
    holds must be what traffic used, not the whole ceiling from the first second."""
    import gc

    from pagedserve.worker.kv_cache import lazy_zeros

    def resident() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    before = resident()
    cache = lazy_zeros((2048, 16, 8, 128), torch.bfloat16)  # 64 MiB
    assert resident() - before < 8 << 20
    cache[:64].fill_(1.0)  # 2 MiB of blocks written
    assert resident() - before < 16 << 20
    assert cache[64:].abs().max().item() == 0 and cache.is_contiguous() and cache.dtype == torch.bfloat16
    del cache
    gc.collect()

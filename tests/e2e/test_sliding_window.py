"""Sliding-window layers in the paged cache (KV-cache groups): the window changes the
outputs (so the parity tests prove it is honoured), and a long decode holds O(window)
blocks per sliding group, which the KV usage figure reports."""

from __future__ import annotations

import pytest
import torch

from pagedserve import LLM, SamplingParams
from tests.e2e.conftest import make_tiny_checkpoint
from tests.e2e.test_hf_parity import hf_greedy
from tests.e2e.token_prompts import shared_prefix_prompts


@pytest.mark.parametrize("arch", ["gemma3", "mistral"])
def test_the_window_changes_hfs_outputs(arch: str, tmp_path) -> None:
    """The parity prompts run past the window: HF without it answers differently, so
    matching HF (test_hf_parity) needs the window honoured."""
    make_tiny_checkpoint(arch, str(tmp_path / "w"))
    make_tiny_checkpoint(arch, str(tmp_path / "wide"), sliding_window=4096)
    prompts = shared_prefix_prompts(512)
    assert hf_greedy(str(tmp_path / "w"), prompts) != hf_greedy(str(tmp_path / "wide"), prompts)


@pytest.mark.parametrize("drafts", [0, 8])
def test_long_decode_holds_the_window_only(tmp_path, drafts: int) -> None:
    """Gemma 3 shape, window 64, one request decoding to 1,024 tokens: once it decodes,
    every sliding group holds at most ceil(64 / 16) + 1 blocks at every step (the prompt's
    step writes all its 100 tokens' KV, 7 blocks; those before the window go at the next
    step), the full group one per 16 tokens, and the KV usage figure is what they hold.
    With n-gram drafts (the CPU default) a step also holds the slots of up to 8 drafts
    past the window: ceil((64 + 8) / 16) + 1."""
    make_tiny_checkpoint("gemma3", str(tmp_path), sliding_window=64, max_position_embeddings=2048)
    bs, window, total = 16, 64, 1024
    spec = {"method": "ngram", "num_speculative_tokens": drafts} if drafts else "off"
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=total + 8, block_size=bs,
              max_num_batched_tokens=256, speculative_config=spec)
    engine = llm.llm_engine
    kvm = engine.kv_cache_manager
    windows = kvm.group_windows
    assert windows.count(None) == 1 and windows.count(window) == 2  # 1 global layer, 2 sliding ones
    prompt = [int(t) for t in torch.randint(3, 500, (100,), generator=torch.Generator().manual_seed(0))]
    engine.add_request("long", {"prompt_token_ids": prompt},
                       SamplingParams(max_tokens=total - len(prompt), ignore_eos=True, temperature=0))
    cap = -(-(window + drafts) // bs) + 1
    most = {g: 0 for g in range(len(windows))}
    steps, generated = 0, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            generated = len(out.outputs[0].token_ids)
        steps += 1
        if "long" not in kvm.req_to_blocks or steps == 1:
            continue
        held = {g: kvm.num_held_blocks("long", g) for g in range(len(windows))}
        for g, n in held.items():
            most[g] = max(most[g], n)
        # The usage figure counts exactly the blocks held.
        assert engine.get_stats().kv_cache_usage == pytest.approx(sum(held.values()) / (kvm.num_blocks - 1))
    sliding = [g for g, w in enumerate(windows) if w is not None]
    full = windows.index(None)
    assert generated == total - len(prompt)
    assert (engine.get_stats().spec_decode_num_accepted_tokens > 0) == bool(drafts)
    assert all(most[g] <= cap for g in sliding), (most, cap)
    assert most[full] >= (total - 1) // bs  # the global layer keeps the whole context
    assert engine.get_stats().kv_cache_usage == 0.0


def test_hybrid_prefix_cache_hit_reuses_the_window(tmp_path) -> None:
    """A prompt sharing a long prefix with a finished one hits the cache in every group:
    the full group's whole prefix, the sliding groups' last window of it, and the output
    is the same as without the cache."""
    make_tiny_checkpoint("gemma3", str(tmp_path), sliding_window=24)
    base = [int(t) for t in torch.randint(3, 500, (150,), generator=torch.Generator().manual_seed(1))]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    cold = LLM(str(tmp_path), dtype="float32", enable_prefix_caching=False)
    want = cold.generate([{"prompt_token_ids": base + [7, 8, 9]}], params, use_tqdm=False)[0].outputs[0].token_ids
    del cold
    llm = LLM(str(tmp_path), dtype="float32")
    llm.generate([{"prompt_token_ids": base + [1, 2]}], params, use_tqdm=False)
    out = llm.generate([{"prompt_token_ids": base + [7, 8, 9]}], params, use_tqdm=False)[0]
    assert out.num_cached_tokens == 144  # 9 whole blocks of the shared 150 tokens
    assert list(out.outputs[0].token_ids) == list(want)

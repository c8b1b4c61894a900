"""The KV tier through the engine: blocks written by one engine are loaded by the next
on the same directory bit for bit, with the same greedy outputs; swap preemption
gives the outputs of no preemption while computing fewer prompt tokens than
recompute preemption."""

from __future__ import annotations

import os

import torch

from pagedserve import LLM, SamplingParams
from pagedserve.core.kv_cache_utils import hash_request_tokens
from pagedserve.engine.llm_engine import LLMEngine
from tests.e2e.test_hf_parity import kv_bytes_for_blocks
from tests.e2e.token_prompts import shared_prefix_prompts

PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def cached_block_bytes(engine: LLMEngine) -> dict[int, list[bytes]]:
    """Every cached block's K/V bytes, per layer tensor, by prefix-cache key."""
    runner = engine.model_executor
    out = {}
    for key, block in engine.kv_cache_manager.block_pool.cached_block_hash_to_block.items():
        out[key] = [t[block.block_id].view(torch.uint8).numpy().tobytes() for kv in runner.kv_caches for t in kv]
    return out


def count_computed_tokens(engine: LLMEngine) -> list[int]:
    """Tokens each step computes, summed in the returned one-element list."""
    total = [0]
    execute = engine.model_executor.execute_model

    def counting(so):
        total[0] += so.total_num_scheduled_tokens
        return execute(so)

    engine.model_executor.execute_model = counting
    return total


def test_offload_then_reload_across_engines(tiny_checkpoint, tmp_path) -> None:
    model_dir, cfg = tiny_checkpoint("llama")
    prompts = shared_prefix_prompts(cfg.vocab_size)
    ref = greedy(LLM(model_dir, dtype="float32"), prompts)

    first = LLM(model_dir, dtype="float32", kv_offload_dir=str(tmp_path))
    assert greedy(first, prompts) == ref
    written = cached_block_bytes(first.llm_engine)
    first.llm_engine.shutdown()  # queued writes finish (the stored count follows the writer thread)
    stats = first.llm_engine.get_stats()
    assert stats.external_prefix_cache_hits == 0 and stats.kv_offload_stored_blocks == len(written) > 8

    second = LLM(model_dir, dtype="float32", kv_offload_dir=str(tmp_path))
    computed = count_computed_tokens(second.llm_engine)
    assert greedy(second, prompts) == ref
    stats = second.llm_engine.get_stats()
    # Every full block of every prompt (but each prompt's last token) came from the disk,
    # the odd prompts' shared 40-token prefix (2 blocks) once, then from the pool ...
    loadable = sum((len(p) - 1) // 16 * 16 for p in prompts)
    assert stats.prefix_cache_hits == loadable
    assert stats.external_prefix_cache_hits == loadable - 3 * 32
    assert computed[0] == sum(len(p) for p in prompts) - loadable + len(prompts) * (PARAMS.max_tokens - 1)
    # ... holding exactly the bytes the first engine computed (the blocks the second one
    # computed itself, the prompts' tails and outputs, may differ in the last bits: its
    # batches had other shapes).
    reloaded = cached_block_bytes(second.llm_engine)
    loaded = {h for p in prompts for h in hash_request_tokens(p, 16)[: (len(p) - 1) // 16]}
    assert len(loaded) == loadable // 16 - 3 * 2 and loaded <= set(written) & set(reloaded)
    assert all(reloaded[k] == written[k] for k in loaded)
    second.llm_engine.shutdown()


def test_a_damaged_directory_costs_recomputation_not_tokens(tiny_checkpoint, tmp_path) -> None:
    model_dir, cfg = tiny_checkpoint("llama")
    prompts = shared_prefix_prompts(cfg.vocab_size)[:4]
    first = LLM(model_dir, dtype="float32", kv_offload_dir=str(tmp_path))
    ref = greedy(first, prompts)
    first.llm_engine.shutdown()
    for i, path in enumerate(sorted(tmp_path.iterdir())):
        data = bytearray(path.read_bytes())
        data[-1 - i % 7] ^= 0xFF  # every file damaged somewhere in its payload
        path.write_bytes(bytes(data))
    second = LLM(model_dir, dtype="float32", kv_offload_dir=str(tmp_path))
    assert greedy(second, prompts) == ref
    stats = second.llm_engine.get_stats()
    assert stats.external_prefix_cache_hits == 0 and stats.kv_offload_invalid_blocks > 0


def test_another_attention_backends_files_are_not_read(tiny_checkpoint, tmp_path, monkeypatch) -> None:
    """The fingerprint named the backend by its class's metaclass ("ABCMeta"), so every
    backend read every other's files: torch_ref's KV loaded under cpu_paged, whose
    answers then differed from its own.  A touched tokenizer file, which changes no KV,
    makes no new fingerprint (a whole bound of files was left behind each time)."""
    model_dir, cfg = tiny_checkpoint("llama")
    prompts = shared_prefix_prompts(cfg.vocab_size)[:4]
    first = LLM(model_dir, dtype="float32", kv_offload_dir=str(tmp_path), attention_backend="torch_ref")
    greedy(first, prompts)
    first.llm_engine.shutdown()
    second = LLM(model_dir, dtype="float32", kv_offload_dir=str(tmp_path))
    greedy(second, prompts)
    assert second.llm_engine.get_stats().external_prefix_cache_hits == 0
    second.llm_engine.shutdown()
    written = sorted(os.listdir(tmp_path))
    tokenizer_files = [f for f in os.listdir(model_dir) if f.startswith("tokenizer")]
    for name in tokenizer_files:
        os.utime(os.path.join(model_dir, name))
    third = LLM(model_dir, dtype="float32", kv_offload_dir=str(tmp_path))
    greedy(third, prompts)
    assert not tokenizer_files or third.llm_engine.get_stats().external_prefix_cache_hits > 0
    third.llm_engine.shutdown()
    assert sorted(os.listdir(tmp_path)) == written
    # another kind of CPU (its kernels round otherwise): another fingerprint
    from pagedserve.worker import kv_offload

    monkeypatch.setattr(kv_offload, "cpu_identity", lambda: "another CPU (AVX2, no native bf16)")
    fourth = LLM(model_dir, dtype="float32", kv_offload_dir=str(tmp_path))
    greedy(fourth, prompts)
    assert fourth.llm_engine.get_stats().external_prefix_cache_hits == 0
    fourth.llm_engine.shutdown()
    # a compiled model (its graph may round K/V otherwise: an eager tier changed a compiled
    # engine's answer); the model itself stands in for the compiled graph here
    from pagedserve.worker import model_runner

    monkeypatch.setattr(model_runner, "maybe_compile", lambda model, *args: model)
    fifth = LLM(model_dir, dtype="float32", kv_offload_dir=str(tmp_path))
    greedy(fifth, prompts)
    assert fifth.llm_engine.get_stats().external_prefix_cache_hits == 0
    fifth.llm_engine.shutdown()


def test_swap_preemption_matches_no_preemption_with_fewer_tokens_computed(tiny_checkpoint) -> None:
    model_dir, cfg = tiny_checkpoint("llama")
    prompts = shared_prefix_prompts(cfg.vocab_size)
    roomy = LLM(model_dir, dtype="float32", enable_prefix_caching=False)
    base = count_computed_tokens(roomy.llm_engine)
    ref = greedy(roomy, prompts)
    longest = max(len(p) for p in prompts) + PARAMS.max_tokens
    blocks = -(-longest // 16) + 2  # room for one request and a block: heavy preemption
    computed, preemptions = {}, {}
    for mode in ("recompute", "swap"):
        llm = LLM(model_dir, dtype="float32", max_model_len=longest, enable_prefix_caching=False,
                  kv_cache_memory_bytes=kv_bytes_for_blocks(cfg, blocks + 1, 16), preemption_mode=mode)
        count = count_computed_tokens(llm.llm_engine)
        assert greedy(llm, prompts) == ref, mode
        computed[mode], preemptions[mode] = count[0], llm.llm_engine.get_stats().num_preemptions
    assert preemptions["recompute"] > 0 and preemptions["swap"] > 0
    # Swapped out and back, a request computes just what it would have without preemption
    # (every prompt token and all but the last generated one, once each).
    assert computed["swap"] == base[0] == sum(len(p) for p in prompts) + len(prompts) * (PARAMS.max_tokens - 1)
    assert computed["recompute"] > base[0], computed


def test_radix_reuses_partial_blocks_with_the_same_outputs(tiny_checkpoint) -> None:
    """Multi-turn chat in token ids: each turn's prompt is the last prompt, its answer
    and a few new tokens.  The radix tree reuses the last turn's partly filled block
    too (copied), so it computes fewer tokens than the hash chain, with the same outputs
    as without any prefix caching."""
    model_dir, cfg = tiny_checkpoint("llama")
    first = shared_prefix_prompts(cfg.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=21, ignore_eos=True)  # answers end mid-block
    results, hits, copies = {}, {}, {}
    for name, kw in {"none": dict(enable_prefix_caching=False), "hash": {},
                     "radix": dict(prefix_caching_algo="radix")}.items():
        llm = LLM(model_dir, dtype="float32", **kw)
        engine = llm.llm_engine
        seen = [0]
        execute = engine.model_executor.execute_model

        def counting(so, execute=execute, seen=seen):
            seen[0] += len(so.kv_transfers.copies) if so.kv_transfers is not None else 0
            return execute(so)

        engine.model_executor.execute_model = counting
        prompts, outs = [list(p) for p in first], []
        for turn in range(3):
            got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            answers = [list(o.outputs[0].token_ids) for o in got]
            outs.append(answers)
            prompts = [p + a + [5 + turn, 7, 11 + i] for i, (p, a) in enumerate(zip(prompts, answers, strict=True))]
        results[name], hits[name], copies[name] = outs, engine.get_stats().prefix_cache_hits, seen[0]
    assert results["radix"] == results["none"] and results["hash"] == results["none"]
    assert copies["hash"] == 0 and copies["radix"] >= 8  # every chat's later turns copy a partial block
    assert hits["radix"] > hits["hash"] > 0, hits


def test_a_hub_ids_new_snapshot_reads_none_of_the_old_ones_blocks(tmp_path, monkeypatch) -> None:
    """A Hub id's weights are its snapshot folder's: the fingerprint hashed the name alone,
    so after refs/main moved to new weights the tier served the old weights' KV."""
    from tests.engine.helpers import make_tiny_llama

    repo = tmp_path / "hub" / "models--acme--tiny"
    for commit, seed in (("aaaa", 0), ("bbbb", 1)):
        torch.manual_seed(seed)
        make_tiny_llama(str(repo / "snapshots" / commit))
    (repo / "refs").mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    prompts = shared_prefix_prompts(512)[:4]

    def run(commit: str, tier: str | None) -> tuple[list[list[int]], int]:
        (repo / "refs" / "main").write_text(commit)
        llm = LLM("acme/tiny", dtype="float32", kv_offload_dir=tier)
        try:
            return greedy(llm, prompts), llm.llm_engine.get_stats().external_prefix_cache_hits
        finally:
            llm.llm_engine.shutdown()

    run("aaaa", str(tmp_path / "kv"))
    assert run("bbbb", str(tmp_path / "kv")) == (run("bbbb", None)[0], 0)
    assert run("aaaa", str(tmp_path / "kv"))[1] > 0  # (its own blocks still load)

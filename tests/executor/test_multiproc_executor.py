"""tp=2 over gloo on CPU: greedy outputs equal tp=1 token for token (float32), and
the worker lifecycle (explicit shutdown, a killed worker) never hangs or leaks.

Starting a tp=2 engine costs a process spawn, so each model gets one (module-scoped)
and the engine variants run on its executor: a variant is a fresh LLMEngine --
scheduler, KV-cache manager, budgets -- over the same ranks.  That is exactly the
part a variant changes: the workers only ever see SchedulerOutputs.  The KV cache
sizing itself (kv_cache_memory_bytes, per rank) is checked by the lifecycle test's
engine, built from scratch with a small cache.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import re
import signal
import threading
import time

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.executor.multiproc_executor import TensorParallelError
from pagedserve.sampling_params import StructuredOutputsParams as S
from tests.distributed.conftest import VOCAB, process_alive
from tests.e2e.token_prompts import shared_prefix_prompts
from tests.engine.helpers import make_tokenizer

MAX_TOKENS = 24
MAX_MODEL_LEN = 128
BASE = dict(dtype="float32", device="cpu", max_model_len=MAX_MODEL_LEN)
MODELS = [("llama", 2), ("llama", 1), ("qwen3", 2), ("qwen3", 1)]  # KV heads split / replicated
# name -> (EngineArgs for the tp=1 reference, SchedulerConfig changes, CacheConfig changes)
VARIANTS = {
    "prefix-caching": ({}, {}, {}),
    "no-prefix-caching": ({"enable_prefix_caching": False}, {}, {"enable_prefix_caching": False}),
    "chunked-prefill-16": ({"max_num_batched_tokens": 16}, {"max_num_batched_tokens": 16}, {}),
    "preemption": ({"num_gpu_blocks_override": 13}, {}, {"num_blocks": 13}),
}


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[dict]]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
            for o in outs]


def _assert_same(ref, ours, name: str) -> None:
    for k, ((rt, rlp), (ot, olp)) in enumerate(zip(ref, ours, strict=True)):
        assert ot == rt, f"{name}: prompt {k} differs: tp=1 {rt} vs tp=2 {ot}"
        for step, (a, b) in enumerate(zip(rlp, olp, strict=True)):
            assert a.keys() == b.keys(), f"{name}: prompt {k} step {step}: top tokens differ"
            for t in a:
                assert abs(a[t] - b[t]) < 1e-3, f"{name}: prompt {k} step {step}: logprob {a[t]} vs {b[t]}"


def _variant(llm: LLM, sched: dict, cache: dict) -> LLM:
    """A new engine with other scheduler/cache settings over `llm`'s tensor-parallel ranks."""
    engine = llm.llm_engine
    engine.step()  # hand the last finished request ids to every rank, so their batches are empty
    cfg = engine.config
    cfg = dataclasses.replace(cfg, scheduler_config=dataclasses.replace(cfg.scheduler_config, **sched),
                              cache_config=dataclasses.replace(cfg.cache_config, **cache))
    return LLM.from_engine(LLMEngine(cfg, engine.model_executor, engine.tokenizer))


@pytest.fixture(scope="module", params=MODELS, ids=lambda m: f"{m[0]}-kv{m[1]}")
def tp2(request, tp_checkpoint):
    path = tp_checkpoint(*request.param)
    llm = LLM(path, tensor_parallel_size=2, **BASE)
    yield path, llm
    llm.shutdown()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tp2_greedy_equals_tp1(tp2, variant: str) -> None:
    path, llm2 = tp2
    ref_args, sched, cache = VARIANTS[variant]
    prompts = shared_prefix_prompts(VOCAB)
    ref_llm = LLM(path, **BASE, **ref_args)
    ref = _greedy(ref_llm, prompts)
    llm = llm2 if variant == "prefix-caching" else _variant(llm2, sched, cache)
    _assert_same(ref, _greedy(llm, prompts), variant)
    stats, ref_stats = llm.llm_engine.get_stats(), ref_llm.llm_engine.get_stats()
    assert (stats.num_preemptions, stats.prefix_cache_hits) == (ref_stats.num_preemptions,
                                                                ref_stats.prefix_cache_hits)
    if variant == "preemption":
        assert stats.num_preemptions > 0
    if variant == "prefix-caching":
        assert stats.prefix_cache_hits > 0


def test_tp2_structured_outputs_equal_tp1(tp2) -> None:
    """Every rank applies the same grammar bitmask before its (seeded) sampler: the
    constrained outputs of tp=2 are tp=1's, token for token, and follow the grammar."""
    path, llm2 = tp2
    tok = make_tokenizer()
    regex = r"[a-f]{2}(-[0-9]{1,3}){2}"
    params = [SamplingParams(temperature=t, seed=i, max_tokens=40, structured_outputs=kind)
              for i, (t, kind) in enumerate([(0.0, S(regex=regex)), (0.9, S(regex=regex)),
                                              (0.9, S(choice=["left", "right"])), (0.0, S(json={"enum": [1, 22]}))])]
    prompts = [{"prompt_token_ids": p} for p in shared_prefix_prompts(VOCAB)[:len(params)]]

    def with_tokenizer(llm: LLM) -> LLM:
        llm.llm_engine.step()  # the ranks forget the last finished requests
        return LLM.from_engine(LLMEngine(llm.llm_engine.config, llm.llm_engine.model_executor, tok))

    ref, llm = with_tokenizer(LLM(path, **BASE)), with_tokenizer(llm2)
    a = ref.generate(prompts, params, use_tqdm=False)
    b = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert all(o.outputs[0].finish_reason == "stop" for o in b)
    assert re.fullmatch(regex, b[0].outputs[0].text) and re.fullmatch(regex, b[1].outputs[0].text)
    assert b[2].outputs[0].text in ("left", "right") and b[3].outputs[0].text in ("1", "22")


def test_tp2_speculative_decoding_equals_tp1_without(tp2) -> None:
    """n-gram drafts verified over tp=2 ranks (every rank computes the draft rows' logits,
    rank 0 verifies): the same tokens as tp=1 decoding one token at a time."""
    from pagedserve.config import SpeculativeConfig

    path, llm2 = tp2
    base = shared_prefix_prompts(VOCAB)
    prompts = base + [p[:12] * 3 for p in base[:4]]
    ref = _greedy(LLM(path, **BASE), prompts)
    engine = llm2.llm_engine
    engine.step()
    cfg = dataclasses.replace(engine.config, speculative_config=SpeculativeConfig(disable_by_batch_size=64))
    llm = LLM.from_engine(LLMEngine(cfg, engine.model_executor, engine.tokenizer))
    _assert_same(ref, _greedy(llm, prompts), "speculative")
    stats = llm.llm_engine.get_stats()
    assert stats.spec_decode_num_drafts > 0 and stats.spec_decode_num_accepted_tokens > 0, stats


def test_shutdown_stops_every_worker(tp2) -> None:
    path, llm = tp2
    executor = llm.llm_engine.model_executor
    pids = executor.worker_pids
    assert pids and all(process_alive(p) for p in pids)
    with pytest.raises(RuntimeError, match="shut that one down first"):
        LLM(path, tensor_parallel_size=2, **BASE)  # one tensor-parallel engine per process
    assert [p.pid for p in multiprocessing.active_children()] == pids
    t0 = time.monotonic()
    llm.shutdown()
    assert time.monotonic() - t0 < 5
    assert not any(process_alive(p) for p in pids)
    llm.shutdown()  # idempotent
    with pytest.raises(RuntimeError, match="was shut down"):  # (the engine's words: it refuses first, for every executor)
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)


def test_small_kv_cache_then_a_killed_worker(tp_checkpoint) -> None:
    """kv_cache_memory_bytes is per rank: with the 2 KV heads split, a rank's block is
    half the size, so half the bytes give tp=1's block count (and its preemptions).
    Then one worker is killed in the middle of a generate()."""
    path = tp_checkpoint("llama", 2)
    block = 2 * 2 * 16 * 2 * 16 * 4  # (k, v) x layers x block_size x kv_heads x head_dim x fp32
    ref_llm = LLM(path, **BASE, kv_cache_memory_bytes=13 * block)
    llm = LLM(path, **BASE, kv_cache_memory_bytes=13 * block // 2, tensor_parallel_size=2)
    assert llm.llm_engine.config.cache_config.num_blocks == ref_llm.llm_engine.config.cache_config.num_blocks == 13
    prompts = shared_prefix_prompts(VOCAB, seed=1)
    _assert_same(_greedy(ref_llm, prompts), _greedy(llm, prompts), "kv_cache_memory_bytes")
    assert llm.llm_engine.get_stats().num_preemptions > 0

    engine, executor = llm.llm_engine, llm.llm_engine.model_executor
    pid = executor.worker_pids[0]
    killed_at: list[float] = []
    base_tokens = engine.get_stats().num_generation_tokens

    def kill_once_generating() -> None:
        deadline = time.monotonic() + 30
        while engine.get_stats().num_generation_tokens <= base_tokens and time.monotonic() < deadline:
            time.sleep(0.005)
        killed_at.append(time.monotonic())
        os.kill(pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_once_generating)
    killer.start()
    long = SamplingParams(temperature=0.0, max_tokens=MAX_MODEL_LEN - 20, ignore_eos=True)
    with pytest.raises(TensorParallelError, match=r"rank 1 \(pid \d+\) was killed by SIGKILL"):
        llm.generate([[i + 3] * 16 for i in range(16)], long, use_tqdm=False)
    failed_at = time.monotonic()
    killer.join()
    assert failed_at - killed_at[0] < 10
    assert not process_alive(pid)
    assert multiprocessing.active_children() == []
    t0 = time.monotonic()
    with pytest.raises(TensorParallelError, match="killed by SIGKILL"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert time.monotonic() - t0 < 1
    llm.shutdown()


def test_a_failing_worker_is_reported_with_its_error(tp_checkpoint) -> None:
    llm = LLM(tp_checkpoint("llama", 1), tensor_parallel_size=2, **BASE)
    executor = llm.llm_engine.model_executor
    pid = executor.worker_pids[0]
    # Only rank 1 gets this call: it raises there, reports, and exits.
    executor._channel.broadcast(("no_such_method", (), False), executor._check, 5)
    t0 = time.monotonic()
    with pytest.raises(TensorParallelError, match=r"rank 1 \(pid \d+\) exited with code 1 after AttributeError"):
        for _ in range(1000):
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert time.monotonic() - t0 < 10
    assert not process_alive(pid)
    llm.shutdown()


def test_executor_runs_a_single_rank(tp_checkpoint) -> None:
    """tp=1 through the executor (process group of one, no workers): the path a single
    GPU runs with distributed_backend='nccl'; here gloo on CPU."""
    import torch

    from pagedserve.engine.arg_utils import EngineArgs
    from pagedserve.executor.multiproc_executor import MultiprocExecutor

    path = tp_checkpoint("qwen3", 2)
    config = EngineArgs(model=path, **BASE).create_engine_config()
    config.parallel_config.distributed_backend = "gloo"
    executor = MultiprocExecutor(config, torch.device("cpu"))
    try:
        assert executor.worker_pids == [] and executor.world_size == 1
        prompts = shared_prefix_prompts(VOCAB, seed=2)[:4]
        ref = _greedy(LLM(path, **BASE), prompts)
        _assert_same(ref, _greedy(LLM.from_engine(LLMEngine(config, executor)), prompts), "tp=1 executor")
    finally:
        executor.shutdown()


"""Overlap (async) scheduling changes when results are processed, never what is
generated: greedy outputs must be identical with it on and off, on CPU here, and on
a GPU also with CUDA graphs on and off.

Covered: stop token ids (so requests stop one step late and their extra token is
dropped), max_tokens 1, min_tokens, penalties and logprobs (the pending token must
count), seeded n > 1 sampling, prefix caching, chunked prefill, preemption in a
small KV cache, and aborts in the middle of a run.  Invariants: no finished
request's block is freed while a step using it is in flight; afterwards no step is
in flight and the KV cache is empty.
"""

from __future__ import annotations

import random

import pytest
import torch

from pagedserve import LLM, SamplingParams

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _prompts(vocab: int, n: int = 10, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    common = [rng.randrange(3, vocab) for _ in range(24)]
    return [common + [rng.randrange(3, vocab) for _ in range(rng.randint(1, 20))] if i % 2
            else [rng.randrange(3, vocab) for _ in range(rng.randint(1, 50))] for i in range(n)]


def _params(stops: list[int]) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=1),
        SamplingParams(temperature=0, max_tokens=30, stop_token_ids=stops),
        SamplingParams(temperature=0, max_tokens=20, stop_token_ids=stops, min_tokens=4),
        SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.3, frequency_penalty=0.5,
                       presence_penalty=0.2, logprobs=3),
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, n=2, max_tokens=12),
        SamplingParams(temperature=0, max_tokens=2, logprobs=0),
        SamplingParams(temperature=0, max_tokens=40, stop_token_ids=stops[:1]),
        SamplingParams(temperature=0, max_tokens=8, min_tokens=8, stop_token_ids=stops),
        SamplingParams(temperature=0, max_tokens=28),
    ]


def _summary(outs) -> list:
    """Tokens, finish and stop reasons, and the logprobs' token ids: all must be equal."""
    return [[(list(c.token_ids), c.finish_reason, c.stop_reason, [list(d) for d in (c.logprobs or [])])
             for c in o.outputs] for o in outs]


def _logprobs(outs) -> list[float]:
    """Every logprob value, in order: the two runs batch requests differently, so these
    may differ in the last bits (a rounding to 4 decimals flipped on one CPU)."""
    return [lp.logprob for o in outs for c in o.outputs for d in (c.logprobs or []) for lp in d.values()]


def _guard_frees(engine) -> None:
    """Fail if a finished request's blocks are freed while a step using them is in flight."""
    sched, kvm = engine.scheduler, engine.kv_cache_manager
    free = kvm.free

    def checked(request):
        if request.is_finished():  # (a preemption frees a running request's blocks on purpose)
            assert not sched.is_in_flight(request), f"{request.request_id}'s blocks freed while in flight"
        free(request)

    kvm.free = checked


def _make(model_dir: str, overlap: bool, **kw) -> LLM:
    llm = LLM(model_dir, dtype="float32", seed=0, async_scheduling=overlap, **kw)
    assert llm.llm_engine.async_scheduling is overlap
    if overlap:
        _guard_frees(llm.llm_engine)
    return llm


def _check_idle(llm: LLM) -> None:
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()  # no step in flight either
    assert engine.scheduler.num_inflight_steps == 0 and engine.scheduler.num_deferred_frees == 0
    assert engine.get_stats().kv_cache_usage == 0


VARIANTS = {
    "default": {},
    "no-prefix-caching": {"enable_prefix_caching": False},
    "chunked-8": {"max_num_batched_tokens": 8, "max_num_seqs": 4},
    # Room for about two requests: constant preemption.  Bytes of 12 blocks of the tiny
    # Qwen3 (2 layers x K and V x 16 slots x 2 KV heads x head_dim 64 x fp32).
    "small-kv": {"kv_cache_memory_bytes": 2 * 2 * 16 * 2 * 64 * 4 * 12, "max_model_len": 96},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_overlap_matches_sync(variant, tiny_checkpoint):
    model_dir, cfg = tiny_checkpoint("qwen3")
    prompts = [{"prompt_token_ids": p} for p in _prompts(cfg.vocab_size)]
    sync = _make(model_dir, False, **VARIANTS[variant])
    # Stop ids that really occur early in the greedy outputs.
    first = sync.generate(prompts, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    stops = sorted({o.outputs[0].token_ids[k] for o in first for k in (2, 4)})[:3]
    params = _params(stops)
    ref_outs = sync.generate(prompts, params, use_tqdm=False)
    ref = _summary(ref_outs)
    assert any(c[1] == "stop" for r in ref for c in r), "no request stopped early: the test lost its point"
    overlap = _make(model_dir, True, **VARIANTS[variant])
    runner = overlap.llm_engine.model_executor
    gathers = 0
    gather = runner._gather_pending

    def counting(*a):
        nonlocal gathers
        gathers += 1
        return gather(*a)

    runner._gather_pending = counting
    got_outs = overlap.generate(prompts, params, use_tqdm=False)
    assert _summary(got_outs) == ref
    assert _logprobs(got_outs) == pytest.approx(_logprobs(ref_outs), abs=1e-4)
    assert gathers > 0, "no step read a token still on the device"
    if variant == "small-kv":
        assert overlap.llm_engine.get_stats().num_preemptions > 0
    _check_idle(sync)
    _check_idle(overlap)


def _run_with_aborts(engine, prompts, params) -> dict:
    final = {}
    for i, p in enumerate(prompts):
        engine.add_request(f"q{i}", p, params)
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = list(out.outputs[0].token_ids)
        steps += 1
        if steps == 3:
            engine.abort_request(["q1", "q4"])
        if steps == 6:
            engine.abort_request(["q6"])
            engine.add_request("late", prompts[0], params)
    return final


def test_aborts_mid_run(tiny_checkpoint):
    model_dir, cfg = tiny_checkpoint("qwen3")
    prompts = [{"prompt_token_ids": p} for p in _prompts(cfg.vocab_size, n=8, seed=1)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    results = {}
    for overlap in (False, True):
        llm = _make(model_dir, overlap, max_num_seqs=4)
        results[overlap] = _run_with_aborts(llm.llm_engine, prompts, params)
        _check_idle(llm)
    for rid in ("q1", "q4", "q6"):
        assert rid not in results[True]
    assert results[True] == results[False]


def test_abort_everything_while_in_flight_leaves_the_engine_idle(tiny_checkpoint):
    model_dir, cfg = tiny_checkpoint("qwen3")
    llm = _make(model_dir, True)
    engine = llm.llm_engine
    engine.add_request("a", [5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=50))
    assert engine.step() == []  # launched; its results come with the next step
    assert engine.scheduler.num_inflight_steps == 1 and engine.has_unfinished_requests()
    engine.abort_request("a")
    _check_idle(llm)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], SamplingParams(temperature=0, max_tokens=5),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 5


def test_async_scheduling_defaults_off_on_cpu(tiny_checkpoint):
    model_dir, _ = tiny_checkpoint("qwen3")
    llm = LLM(model_dir, dtype="float32", device="cpu")  # (the default device is CUDA where there is one)
    assert llm.llm_engine.async_scheduling is False


@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_graphs_and_overlap_match_eager(dtype, tiny_checkpoint):
    """On CUDA: CUDA graphs on/off x overlap on/off, all four greedy-identical."""
    model_dir, cfg = tiny_checkpoint("qwen3")
    prompts = [{"prompt_token_ids": p} for p in _prompts(cfg.vocab_size, n=24, seed=2)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    results = {}
    for eager in (True, False):
        for overlap in (False, True):
            llm = LLM(model_dir, dtype=dtype, device="cuda", enforce_eager=eager, async_scheduling=overlap,
                      max_num_seqs=20)
            runner = llm.llm_engine.model_executor
            assert runner.graph_runner.use_graphs is not eager  # eager: the same padded shapes, uncaptured
            results[eager, overlap] = [list(o.outputs[0].token_ids)
                                       for o in llm.generate(prompts, params, use_tqdm=False)]
            assert runner.graph_runner.num_replays > 0
            _check_idle(llm)
            del llm
            torch.cuda.empty_cache()
    ref = results[True, False]
    for key, got in results.items():
        assert got == ref, key


def test_multi_token_bad_words_hold_under_overlap(tmp_path) -> None:
    """A bad word's prefix ending with the token still on the device: the check saw only
    the host's tokens, so under overlap a word got through, and a word whose prefix the
    host's tail matched banned its last token a step late (after another token)."""
    from transformers import AutoTokenizer

    from tests.engine.helpers import make_tiny_llama

    make_tiny_llama(str(tmp_path))
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    prompts = [" the quick brown fox Italy?hello world", "What is the capital of France?", "hello hello hello"]
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    sync = LLM(str(tmp_path), dtype="float32", max_model_len=128, speculative_config="off")
    overlap = LLM(str(tmp_path), dtype="float32", max_model_len=128, speculative_config="off", async_scheduling=True)
    checked = 0
    for prompt in prompts:
        ids = sync.generate([prompt], plain, use_tqdm=False)[0].outputs[0].token_ids
        for k in range(2, 8):
            word = tok.decode(ids[k:k + 2])  # two tokens the answer says: the ban must hold mid-answer
            if tok.encode(word, add_special_tokens=False) != list(ids[k:k + 2]):
                continue
            params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, bad_words=[word])
            want = sync.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
            assert overlap.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == want, (prompt, word)
            checked += 1
    assert checked >= 3

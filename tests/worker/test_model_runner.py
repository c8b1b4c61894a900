"""ModelRunner end to end with a toy model: paged, chunked, batched, preempted
generation must equal a plain recomputation without any cache."""

from __future__ import annotations

import logging

import pytest
import torch
from worker_helpers import Driver, ToyModel, toy_config

from pagedserve.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from pagedserve.sampling_params import SamplingParams
from pagedserve.worker.model_runner import ModelRunner


def make_runner(block_size=16, budget=512, backend=None, **kw):
    config = toy_config(block_size=block_size, max_num_batched_tokens=budget, **kw)
    config.device_config.attention_backend = backend
    model = ToyModel().eval()
    runner = ModelRunner(config, model)
    return runner, model


def reference_greedy(model: ToyModel, prompt: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    tokens, lps = list(prompt), []
    for _ in range(n):
        logits = model.reference_logits(tokens)[-1]
        lps.append(logits.log_softmax(-1))
        tokens.append(int(logits.argmax()))
    return tokens[len(prompt):], lps


def prompts(seed: int, count: int, lo: int = 3, hi: int = 70) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (count,), generator=g).tolist()
    return [torch.randint(2, 97, (n,), generator=g).tolist() for n in lens]


@pytest.mark.parametrize("backend", ["torch_paged", "torch_ref"])
@pytest.mark.parametrize("block_size,budget", [(16, 512), (32, 512), (16, 24)])
def test_greedy_matches_recomputation(block_size, budget, backend):
    runner, model = make_runner(block_size, budget, backend=backend, kv_cache_memory_bytes=1 << 20)
    num_blocks = runner.initialize_kv_cache()
    drv = Driver(runner, num_blocks, budget, seed=block_size)
    ps = prompts(block_size + budget, 6)
    params = SamplingParams(temperature=0.0, logprobs=3, max_tokens=12)
    for i, p in enumerate(ps):
        drv.add(f"r{i}", p, params, max_tokens=12)
    # A request sharing r0's first full block (prefix cache hit) joins later.
    shared = ps[0][:block_size] if len(ps[0]) > block_size else None
    steps = 0
    while drv.reqs:
        drv.step()
        steps += 1
        if steps == 3 and shared is not None:
            drv.add("hit", shared + [5, 6, 7], params, max_tokens=12, share_from="r0", shared_blocks=1)
            ps.append(shared + [5, 6, 7])
        if steps == 5 and "r1" in drv.reqs:
            drv.preempt("r1")
    drv.step()
    done = drv.done
    for i, p in enumerate(ps):
        rid = f"r{i}" if i < 6 else "hit"
        expect, ref_lps = reference_greedy(model, p, 12)
        assert done[rid]["out"] == expect, rid
    # Logprobs are the raw distribution's: check r2's against the reference.
    entries = [o.logprobs["r2"] for _, o in drv.outputs if "r2" in o.logprobs]
    _, ref_lps = reference_greedy(model, ps[2], 12)
    assert len(entries) == 12
    for e, ref in zip(entries, ref_lps, strict=True):
        assert e.rank == 1 and e.topk_token_ids[0] == e.token_id and len(e.topk_token_ids) == 3
        torch.testing.assert_close(torch.tensor(e.topk_logprobs), ref.topk(3).values, atol=1e-4, rtol=1e-4)


def test_chunked_prompt_gets_no_token_until_complete():
    runner, _ = make_runner(16, 10, kv_cache_memory_bytes=1 << 20)
    runner.initialize_kv_cache()
    drv = Driver(runner, runner.config.cache_config.num_blocks, budget=10)
    drv.add("a", list(range(2, 27)), SamplingParams(temperature=0), max_tokens=2)
    assert drv.step().sampled_token_ids == {}  # tokens 0..9
    assert drv.step().sampled_token_ids == {}  # 10..19
    out = drv.step()  # 20..24: the prompt is complete
    assert list(out.sampled_token_ids) == ["a"] and out.req_ids == ["a"]


def test_seeded_sampling_is_batch_independent():
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=10)

    def run(extra: int) -> list[int]:
        runner, _ = make_runner(16, 512, kv_cache_memory_bytes=1 << 20)
        drv = Driver(runner, runner.initialize_kv_cache(), 512, seed=extra)
        for i in range(extra):
            drv.add(f"x{i}", prompts(extra, extra)[i], SamplingParams(temperature=0.8, seed=i), max_tokens=7)
        drv.add("s", [5, 9, 11, 40], params, max_tokens=10)
        drv.run()
        return drv.done["s"]["out"]

    assert run(0) == run(3) == run(5)


def test_kv_cache_log_and_binding(caplog):
    runner, model = make_runner(16, 512, kv_cache_memory_bytes=1 << 20)
    with caplog.at_level(logging.INFO, logger="pagedserve"):
        num_blocks = runner.initialize_kv_cache()
    # 2 layers x K,V x 16 slots x 2 kv heads x 16 dims x 4 bytes = 8 KiB a block.
    assert num_blocks == (1 << 20) // 8192
    msg = (f"KV cache on cpu: 0.00 GiB = {num_blocks - 1} blocks of 16 tokens ({(num_blocks - 1) * 16} tokens, "
           f"float32, 512 bytes per token; max concurrency at max_model_len:")
    assert any(msg in r.getMessage() for r in caplog.records)
    for layer, (k, v) in zip(runner.attn_layers, runner.kv_caches, strict=True):
        assert layer.kv_cache[0] is k and k.shape == (num_blocks, 16, 2, 16)
        assert torch.all(k[0] == 0) and torch.all(v[0] == 0)
        assert layer.impl is not None


def test_bad_scheduler_output_is_a_value_error():
    runner, _ = make_runner(16, 512, kv_cache_memory_bytes=1 << 20)
    runner.initialize_kv_cache()
    params = SamplingParams(temperature=0)
    new = NewRequestData("a", [3, 4, 5], [], params, [1], 0)
    bad = SchedulerOutput([new], CachedRequestData(), {"a": 5}, 5, set(), set())
    with pytest.raises(ValueError, match="5 tokens scheduled after 0 computed, but it has 3 tokens"):
        runner.execute_model(bad)
    ghost = CachedRequestData(["nope"], [[]], [[]], [0])
    with pytest.raises(ValueError, match="unknown to the model runner"):
        runner.execute_model(SchedulerOutput([], ghost, {"nope": 1}, 1, set(), set()))


def test_execute_before_kv_cache_is_an_error():
    runner, _ = make_runner()
    with pytest.raises(RuntimeError, match="initialize_kv_cache"):
        runner.execute_model(SchedulerOutput([], CachedRequestData(), {}, 0, set(), set()))


def test_preempted_seeded_request_continues_its_stream():
    params = SamplingParams(temperature=1.0, seed=99, max_tokens=12)

    def run(preempt_at: int | None) -> list[int]:
        runner, _ = make_runner(16, 512, kv_cache_memory_bytes=1 << 20)
        drv = Driver(runner, runner.initialize_kv_cache(), 512)
        drv.add("s", [4, 8, 15, 16, 23, 42], params, max_tokens=12)
        for step in range(40):
            if not drv.reqs:
                break
            if step == preempt_at:
                drv.preempt("s")
            drv.step()
        return drv.done["s"]["out"]

    plain = run(None)
    assert len(set(plain)) > 2
    assert run(4) == plain


def test_exact_prompt_attention_sets_the_runners_horizon():
    """exact_prompt_attention (the default) offers every position to the CPU kernel's
    exact rows; off, none (the blocked prefill paths)."""
    from pagedserve.attention import cpu_paged
    from pagedserve.attention.backend import EVERY_POSITION

    if cpu_paged.paged_decode() is None:
        pytest.skip("needs the C++ decode kernel (no C++ compiler on this machine)")
    for exact, want in ((True, EVERY_POSITION), (False, 0)):
        config = toy_config()
        config.device_config.exact_prompt_attention = exact
        runner = ModelRunner(config, ToyModel(head_dim=64).eval())  # (64: a head size the kernel takes)
        runner.initialize_kv_cache()
        assert runner.exact_rows_context == want

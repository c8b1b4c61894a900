"""Structured outputs end to end on a tiny random Llama: whatever the model wants to say,
the output follows the grammar, in every scheduling mode the engine has."""

from __future__ import annotations

import json
import re
from concurrent.futures import Future

import jsonschema
import pytest

from pagedserve import LLM, SamplingParams, structured_output
from pagedserve.config import SchedulerConfig
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.request import Request, RequestStatus
from pagedserve.core.scheduler import Scheduler
from pagedserve.errors import InvalidRequestError
from pagedserve.sampling_params import StructuredOutputsParams as S
from pagedserve.structured_output import StructuredOutputManager, StructuredOutputRequest
from tests.engine.helpers import make_tiny_llama, make_tokenizer

SCHEMA = {"type": "object", "required": ["n", "ok", "tags"], "properties": {
    "n": {"type": "integer", "minimum": -50, "maximum": 50}, "ok": {"type": "boolean"},
    "tags": {"type": "array", "maxItems": 2, "items": {"enum": ["a", "bb"]}}}}
REGEX = r"[a-f]{2}(-[0-9]{1,3}){2}"
CHOICES = ["alpha", "beta", "gamma delta"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiny-llama-so"))
    make_tiny_llama(path, vocab_size=400)
    return path


def constrained_batch(temperature: float) -> tuple[list, list[SamplingParams]]:
    prompts = [{"prompt_token_ids": [5 + i, 17, 33, 2 + 3 * i, 90] * (1 + i % 3)} for i in range(6)]
    kinds = [S(json=SCHEMA), S(regex=REGEX), S(choice=CHOICES), S(json=SCHEMA), None, S(regex=REGEX)]
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=60, n=2 if i == 3 else 1,
                             structured_outputs=k) for i, k in enumerate(kinds)]
    return prompts, params


def check(outputs, params) -> list:
    texts = []
    for out, p in zip(outputs, params, strict=True):
        for c in out.outputs:
            texts.append(c.token_ids)
            kind = p.structured_outputs
            if kind is None:
                continue
            assert c.finish_reason == "stop", (c.text, c.finish_reason)
            if kind.json is not None:
                jsonschema.validate(json.loads(c.text), SCHEMA)
            elif kind.regex is not None:
                assert re.fullmatch(REGEX, c.text), c.text
            else:
                assert c.text in CHOICES
    return texts


CONFIGS = {
    "default": {},
    "chunked-prefill": {"max_num_batched_tokens": 8, "long_prefill_token_threshold": 4},
    "preemption": {"num_gpu_blocks_override": 40, "block_size": 4},
    "no-prefix-caching": {"enable_prefix_caching": False},
    "overlap": {"async_scheduling": True},
}


BACKENDS = ["guidance", "xgrammar"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_every_output_follows_its_grammar_in_every_scheduling_mode(tiny_dir, temperature, backend):
    prompts, params = constrained_batch(temperature)
    results = {}
    for name, kw in CONFIGS.items():
        llm = LLM(tiny_dir, dtype="float32", max_model_len=128, seed=0, structured_outputs_backend=backend, **kw)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        results[name] = check(outputs, params)
        stats = llm.llm_engine.get_stats()
        assert stats.kv_cache_usage == 0 and not llm.llm_engine.has_unfinished_requests()
        if name == "preemption":
            assert stats.num_preemptions > 0
        llm.shutdown()
    # Greedy, or seeded: the schedule changes nothing (preemption replays the matcher too).
    assert all(r == results["default"] for r in results.values()), results


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_grammar_that_allows_every_token_changes_nothing(tiny_dir, backend):
    tok = make_tokenizer()
    # Added tokens (<|im_start|>, ...) are not text to llguidance: left out for both backends.
    printable = [t for t in range(len(tok)) if t not in tok.get_added_vocab().values()
                 and re.fullmatch(r"[ -~\n]+", tok.decode([t]))]
    llm = LLM(tiny_dir, dtype="float32", max_model_len=128, structured_outputs_backend=backend)
    prompts = [{"prompt_token_ids": [5 + i, 9, 33, 2 + i]} for i in range(4)]
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, allowed_token_ids=printable)
    everything = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, allowed_token_ids=printable,
                                structured_outputs=S(regex=r"[ -~\n]*"))
    a = llm.generate(prompts, free, use_tqdm=False)
    b = llm.generate(prompts, everything, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


@pytest.mark.parametrize("backend", BACKENDS)
def test_max_tokens_mid_structure_is_length_and_a_valid_prefix(tiny_dir, backend):
    llm = LLM(tiny_dir, dtype="float32", max_model_len=128, structured_outputs_backend=backend)
    [out] = llm.generate({"prompt_token_ids": [3, 4, 5]},
                         SamplingParams(temperature=0, max_tokens=3, structured_outputs=S(json=SCHEMA)), use_tqdm=False)
    c = out.outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 3 and '{"n": '.startswith(c.text[:6])


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_invalid_grammar_is_a_value_error_before_anything_runs(tiny_dir, backend):
    llm = LLM(tiny_dir, dtype="float32", max_model_len=128, structured_outputs_backend=backend)
    for bad, message in [(S(json={"type": "objekt"}), "invalid JSON schema"), (S(regex="[a-"), "invalid regex"),
                         (S(grammar="root ::= ("), "invalid grammar")]:
        with pytest.raises(ValueError, match=message):
            llm.generate(["hello", "world"], [SamplingParams(), SamplingParams(structured_outputs=bad)],
                         use_tqdm=False)
        assert not llm.llm_engine.has_unfinished_requests()
    [ok] = llm.generate("hello", SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(ok.outputs[0].token_ids) == 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiles_are_cached_by_spec_and_errors_carry_the_compilers_message(monkeypatch, backend):
    monkeypatch.setattr(structured_output, "GRAMMAR_CACHE_SIZE", 3)
    mgr = StructuredOutputManager(make_tokenizer(), 400, [2], max_num_seqs=4, backend=backend)
    first = mgr.compile(S(regex="[ab]+"))
    assert mgr.compile(S(regex="[ab]+")) is first and mgr.num_cache_hits == 0  # looking up is not a hit
    assert mgr.claim(S(regex="[ab]+")) is first and mgr.num_cache_hits == 0  # the first request compiled it
    assert mgr.claim(S(regex="[ab]+")) is first and mgr.num_cache_hits == 1  # the second reuses it
    first.result()
    assert mgr.num_compiled == 1 and mgr.compile_seconds > 0
    others = [mgr.compile(S(regex=f"x{i}")) for i in range(2)]
    assert mgr.compile(S(regex="[ab]+")) is first  # used last: kept
    mgr.compile(S(regex="x9"))  # the cache holds 3: the least recently used (x0) goes
    assert mgr.compile(S(regex="x1")) is others[1] and mgr.compile(S(regex="x0")) is not others[0]
    bad = mgr.compile(S(json='{"type": "objekt"}'))
    with pytest.raises(InvalidRequestError) as e:
        bad.result()
    assert e.value.param == "structured_outputs" and "objekt" in str(e.value) and ".cc:" not in str(e.value)
    assert mgr.compile(S(json='{"type": "objekt"}')) is not bad  # a failure is not cached
    mgr.shutdown()


def test_the_grammar_cache_keeps_a_bounded_size_of_specs(monkeypatch):
    """Counted by entries alone, 256 large schemas (a client's each) kept 4.2 GB of compiled
    grammars for good; the specs' characters are bounded too, the newest always kept."""
    monkeypatch.setattr(structured_output, "GRAMMAR_CACHE_SPEC_CHARS", 100)
    mgr = StructuredOutputManager(make_tokenizer(), 400, [2], max_num_seqs=4, backend=BACKENDS[0])
    small = mgr.compile(S(regex="a+"))
    large = [mgr.compile(S(regex="b" * 40 + f"{i}")) for i in range(2)]  # (41 + 41 + 2 characters)
    assert mgr.compile(S(regex="a+")) is small and mgr.compile(S(regex="b" * 40 + "0")) is large[0]
    third = mgr.compile(S(regex="b" * 40 + "2"))  # past 100: the least recently used (b..1) goes
    assert mgr.compile(S(regex="b" * 40 + "1")) is not large[1]  # (compiled again: now b..0 went)
    huge = mgr.compile(S(regex="c" * 150))  # larger than the budget alone: kept, every other one goes
    assert mgr.compile(S(regex="c" * 150)) is huge and mgr.compile(S(regex="a+")) is not small
    assert third.result() is not None and huge.result() is not None
    mgr.shutdown()


def test_the_scheduler_steps_over_a_request_whose_grammar_is_compiling():
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64),
                      KVCacheManager(32, 4, 64))
    compiling: Future = Future()
    slow = Request("slow", [1, 2, 3], SamplingParams(max_tokens=4), grammar=StructuredOutputRequest(compiling))
    free = Request("free", [4, 5, 6], SamplingParams(max_tokens=4))
    sched.add_request(slow)
    sched.add_request(free)
    assert slow.status is RequestStatus.WAITING_FOR_FSM
    out = sched.schedule()
    assert list(out.num_scheduled_tokens) == ["free"] and slow.num_computed_tokens == 0
    assert sched.kv_cache_manager.get_block_ids("slow") == []  # no KV block while it waits
    sched.update_from_output(out, {"free": [7]})
    compiling.set_result(StructuredOutputManager(make_tokenizer(), 400, [2], 4).compile(S(regex="a+")).result())
    out = sched.schedule()
    # free decodes (row 0 of the sampled rows), slow's prompt completes and samples (row 1).
    assert list(out.num_scheduled_tokens) == ["free", "slow"] and out.structured_output_rows == {"slow": 1}


def test_a_client_that_leaves_never_cancels_the_compile_others_share(tiny_dir, monkeypatch):
    """A request waiting for its grammar is cancelled when its client hangs up; the
    compile is cached and shared by spec, so the wait is shielded (a cancelled compile
    had answered every later request with that schema with an empty 499), and a cached
    compile that was cancelled anyway is compiled again."""
    import asyncio
    import threading

    from pagedserve.engine.inproc_client import InprocClient

    llm = LLM(tiny_dir, dtype="float32", speculative_config="off")
    mgr = llm.llm_engine.input_processor.structured_output
    gate, real = threading.Event(), mgr._compile
    monkeypatch.setattr(mgr, "_compile", lambda key: (gate.wait(30), real(key))[1])
    params = SamplingParams(max_tokens=4, structured_outputs=S(regex="[ab]+"))
    client = InprocClient(llm.llm_engine)

    async def main():
        blockers = [mgr.compile(S(regex=r)) for r in ("x+", "y+")]  # every compile thread busy: it queues
        leaving = asyncio.ensure_future(client.prepare("leaves", [1, 5, 9], params, 0, None, 0.0))
        await asyncio.sleep(0.2)  # waiting on the (blocked) compile
        leaving.cancel()
        await asyncio.sleep(0.05)
        gate.set()
        assert all(b.result() is not None for b in blockers)
        return await asyncio.wait_for(client.prepare("stays", [1, 5, 9], params, 0, None, 0.0), 30)

    request = asyncio.run(main())
    assert not request.grammar.cancelled() and request.grammar.result() is not None
    # A cached compile cancelled some other way (still queued): compiled again
    one = StructuredOutputManager(make_tokenizer(), 400, [2], max_num_seqs=4, max_workers=1)
    hold = threading.Event()
    monkeypatch.setattr(one, "_compile", lambda key, real=one._compile: (hold.wait(30), real(key))[1])
    busy, queued = one.compile(S(regex="b+")), one.compile(S(regex="a+"))
    assert queued.cancel()
    hold.set()
    again = one.compile(S(regex="a+"))
    assert again is not queued and again.result() is not None and busy.result() is not None
    one.shutdown()

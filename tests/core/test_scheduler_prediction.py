"""Predicted outputs in the scheduler: a request drafts from its own prediction with
speculation off and past disable_by_batch_size, outputs are those without drafts, and
the counts reach every EngineCoreOutput of the request."""

from __future__ import annotations

from core_helpers import FakeRunner, make_scheduler, run_to_completion

from pagedserve.core.request import Request
from pagedserve.sampling_params import SamplingParams

MAX_TOKENS = 40


def counting(rid: str, context: list[int]) -> int:
    """A deterministic model whose output is easy to predict: 1 2 3 ... 9 1 2 ..."""
    return 1 + len(context) % 9


def expected_output(prompt_len: int) -> list[int]:
    return [counting("", [0] * (prompt_len + i)) for i in range(MAX_TOKENS)]


def run(num_speculative_tokens: int | None, predictions: list[list[int] | None], max_num_seqs: int = 16):
    sched = make_scheduler(num_blocks=200, block_size=4, max_model_len=128, max_num_seqs=max_num_seqs,
                           num_speculative_tokens=num_speculative_tokens)
    if num_speculative_tokens:
        sched.speculative_config.disable_by_batch_size = 1  # the n-gram drafter is off past 1 request
    reqs = [Request(str(i), [50 + i] * (6 + i), SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
                    prediction_token_ids=p) for i, p in enumerate(predictions)]
    for r in reqs:
        sched.add_request(r)
    outs = run_to_completion(sched, FakeRunner(sched), sample=counting)
    assert sched.kv_cache_manager.usage == 0 and not sched.num_prediction_requests
    return reqs, outs, sched


def test_a_prediction_drafts_with_speculation_off_and_the_output_is_unchanged() -> None:
    edited = expected_output(6)
    edited[10:12] = [77, 78, 79]  # the model will not write this: a few rejected drafts, then the place again
    predictions = [edited, None, expected_output(8)[:20]]
    base, _, _ = run(None, [None] * 3)
    reqs, outs, sched = run(None, predictions)
    assert [r.output_token_ids for r in reqs] == [r.output_token_ids for r in base]
    assert reqs[1].prediction is None
    assert reqs[0].prediction.counts[0] >= 15 and reqs[0].prediction.counts[1] >= 1  # the edit's drafts missed
    assert reqs[2].prediction.counts[0] >= 15
    assert sched.spec_stats.num_drafts > 0
    by_id = {}
    for o in outs:
        by_id.setdefault(o.request_id, []).append(o)
    assert all(o.prediction_counts is None for o in by_id["1"])
    assert by_id["0"][-1].prediction_counts == reqs[0].prediction.counts and by_id["0"][-1].finished


def test_a_prediction_drafts_past_disable_by_batch_size_and_others_use_ngram_below_it() -> None:
    base, _, _ = run(4, [None] * 3)
    reqs, _, sched = run(4, [expected_output(6), None, None])
    assert [r.output_token_ids for r in reqs] == [r.output_token_ids for r in base]
    assert reqs[0].prediction.counts[0] >= 30  # three running: only the prediction drafted
    # (its drafts are all the accepted drafts; the usage counts the first and bonus tokens too)
    accepted, rejected = reqs[0].prediction.counts
    assert base[0].num_preemptions == 0 and 0 < sched.spec_stats.num_accepted_tokens < accepted
    assert (accepted, rejected) == (MAX_TOKENS, len(expected_output(6)) - MAX_TOKENS)


def test_a_prediction_with_nothing_to_propose_falls_back_to_prompt_lookup() -> None:
    """The output repeats itself (1..9), the prediction never matches it: the request
    drafts by prompt lookup even with speculation off, and those drafts are not the
    prediction's: none of its tokens appears in the completion, all four are rejected
    (OpenAI's count; it said 0 of 1 by the drafts it proposed)."""
    base, _, _ = run(None, [None])
    reqs, _, sched = run(None, [[500, 501, 502, 503]])
    assert reqs[0].output_token_ids == base[0].output_token_ids
    assert reqs[0].prediction.counts == (0, 4)
    assert sched.spec_stats.num_accepted_tokens >= MAX_TOKENS // 2


def test_a_prediction_request_the_runner_could_not_sample_finishes_with_an_error() -> None:
    """Its row's logits were not a distribution (NaN): it has no sampled tokens, and the
    prediction's count of them took len(None), an engine-thread TypeError for every request."""
    sched = make_scheduler(num_blocks=50, block_size=4, max_model_len=64)
    req = Request("p", [5, 6, 7], SamplingParams(max_tokens=4), prediction_token_ids=[1, 2, 3])
    sched.add_request(req)
    out = sched.schedule()
    (result,) = sched.update_from_output(out, {}, invalid_req_ids={"p": None})
    assert result.finished and result.finish_reason == "error" and result.predicted == b""
    assert result.prediction_counts == (0, 3) and sched.kv_cache_manager.usage == 0

"""Predicted outputs through the real engine (a tiny random model): greedy and seeded
outputs are token for token those without a prediction, with speculation off (the
prediction is the request's own draft source) and with n-gram drafting on, one request
at a time and batched, and the prediction's drafts were really accepted."""

from __future__ import annotations

import pytest

from pagedserve import LLM, SamplingParams
from tests.e2e.test_spec_decode import NGRAM, prompts_for

MAX_TOKENS = 48


def edited(tokens: list[int], vocab: int) -> list[int]:
    """The output as a client might predict it: one token changed, three inserted, five dropped."""
    return tokens[:10] + [(tokens[10] + 1) % vocab] + tokens[11:20] + [5, 6, 7] + tokens[20:30] + tokens[35:]


def generate(llm: LLM, prompts: list[list[int]], params: list[SamplingParams], one_at_a_time: bool):
    reqs = [{"prompt_token_ids": p} for p in prompts]
    if one_at_a_time:
        return [llm.generate([r], sp, use_tqdm=False)[0].outputs[0] for r, sp in zip(reqs, params, strict=True)]
    return [o.outputs[0] for o in llm.generate(reqs, params, use_tqdm=False)]


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 0.8, "seed": 11}],
                         ids=["greedy", "seeded"])
def test_outputs_identical_with_and_without_a_prediction(tiny_checkpoint, sampling) -> None:
    model_dir, hf_cfg = tiny_checkpoint("llama")
    vocab = hf_cfg.vocab_size
    prompts = prompts_for(vocab)[:6]
    plain = [SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **sampling) for _ in prompts]
    engines = {"off": LLM(model_dir, dtype="float32", seed=0, speculative_config="off"),
               "ngram": LLM(model_dir, dtype="float32", seed=0, speculative_config=NGRAM)}
    want = [list(c.token_ids) for c in generate(engines["off"], prompts, plain, one_at_a_time=False)]
    for c in generate(engines["off"], prompts, plain, one_at_a_time=False):
        assert c.accepted_prediction_tokens is None and c.rejected_prediction_tokens is None
    predicted = [SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, prediction=edited(w, vocab), **sampling)
                 for w in want]
    for name, llm in engines.items():
        for one in (True, False):
            got = generate(llm, prompts, predicted, one)
            assert [list(c.token_ids) for c in got] == want, (name, one)
            accepted = sum(c.accepted_prediction_tokens for c in got)
            rejected = sum(c.rejected_prediction_tokens for c in got)
            assert accepted > len(prompts) * MAX_TOKENS // 2, (name, one, accepted, rejected)
            assert rejected > 0  # the changed and inserted tokens were drafted and refused
    # Nothing of the prediction is left behind in the engine.
    for llm in engines.values():
        assert not llm.llm_engine.has_unfinished_requests()
        assert llm.llm_engine.scheduler.num_prediction_requests == 0


def test_text_prediction_and_refusals(tmp_path) -> None:
    from tests.engine.helpers import make_tiny_llama

    make_tiny_llama(str(tmp_path))
    llm = LLM(str(tmp_path), dtype="float32", seed=0, speculative_config="off")
    prompt = "hello world hello world hello"
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
    got = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                                prediction=want.text), use_tqdm=False)[0].outputs[0]
    assert (got.text, list(got.token_ids)) == (want.text, list(want.token_ids))
    assert got.accepted_prediction_tokens > 0
    with pytest.raises(ValueError, match="characters") as info:
        llm.generate([prompt], SamplingParams(prediction="x " * llm.llm_engine.max_prompt_chars), use_tqdm=False)
    assert info.value.param == "prediction"
    with pytest.raises(ValueError, match="presence_penalty"):
        llm.generate([prompt], SamplingParams(prediction="x", presence_penalty=0.5), use_tqdm=False)


def test_accepted_prediction_tokens_are_in_the_completion_whatever_stops_it(tmp_path) -> None:
    """A stop inside a step of accepted drafts (a stop token, a stop string; max_tokens
    drafts no further) cuts them off the output: they count as rejected, never as accepted
    (OpenAI's accepted tokens are the prediction's tokens that appear in the completion)."""
    from tests.engine.helpers import make_tiny_llama

    make_tiny_llama(str(tmp_path))
    llm = LLM(str(tmp_path), dtype="float32", seed=0, speculative_config="off")
    prompt = "hello world hello world hello"
    want = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    ids = list(want.token_ids)
    k = next(i for i in range(12, len(ids)) if ids.index(ids[i]) == i)  # a token first seen mid-output
    stop_text = want.text[len(want.text) // 2:][:4]
    cases = {"stop token": {"stop_token_ids": [ids[k]]}, "max_tokens": {"max_tokens": 13},
             "stop string": {"stop": [stop_text]}}
    for name, kw in cases.items():
        base = {"temperature": 0.0, "max_tokens": 40, "ignore_eos": True, **kw}
        plain = llm.generate([prompt], SamplingParams(**base), use_tqdm=False)[0].outputs[0]
        got = llm.generate([prompt], SamplingParams(**base, prediction=ids), use_tqdm=False)[0].outputs[0]
        assert (got.text, list(got.token_ids)) == (plain.text, list(plain.token_ids)), name
        assert len(got.token_ids) < len(ids), name  # (it did stop early)
        # every token of the completion is the prediction's (the first and bonus ones too);
        # the prediction's tokens past the stop are rejected
        assert (got.accepted_prediction_tokens, got.rejected_prediction_tokens) == (
            len(got.token_ids), len(ids) - len(got.token_ids)), name

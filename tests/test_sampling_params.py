"""SamplingParams validation: the one place sampling values are range-checked."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.errors import InvalidRequestError
from pagedserve.sampling_params import SamplingParams, StructuredOutputsParams
from tests.hypothesis_budget import examples

NUMERIC_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                  "repetition_penalty", "max_tokens", "min_tokens", "logprobs")
FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
# What an abuser sends: non-finite, huge, negative, zero, and the wrong type.
HOSTILE = st.sampled_from([math.nan, math.inf, -math.inf, 1e308, -1e308, 10**30, -(10**30), -1, -1.5, 0, 0.5,
                           2**63, "1", "NaN", None, [], {}, True, b"x"])


@settings(max_examples=examples(300), deadline=None)
@given(field=st.sampled_from(NUMERIC_FIELDS), value=HOSTILE)
def test_hostile_values_are_refused_cleanly_or_accepted_finite(field, value):
    try:
        params = SamplingParams(**{field: value})
    except InvalidRequestError as e:
        assert e.param == field or (field == "max_tokens" and e.param == "min_tokens")
        assert field in str(e) or "min_tokens" in str(e)
        return
    accepted = getattr(params, field)
    if accepted is not None:  # whatever got through is a finite number of the right kind
        assert isinstance(accepted, (int, float)) and not isinstance(accepted, bool)
        assert math.isfinite(accepted)


@pytest.mark.parametrize("field", FLOAT_FIELDS)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_floats_name_the_field(field, value):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**{field: value})
    assert e.value.param == field and isinstance(e.value, ValueError)


def test_a_field_changed_after_construction_is_validated_again():
    p = SamplingParams(stop="x")
    assert p.stop_strings == ["x"]
    p.stop = ["a", "b"]
    assert p.stop_strings == ["a", "b"]  # derived, not a copy taken at construction
    p.stop = 5
    with pytest.raises(InvalidRequestError, match="stop"):
        p.validate()
    p.stop = None
    p.temperature = math.nan
    with pytest.raises(InvalidRequestError, match="temperature"):
        p.validate()


def test_bool_fields_and_seed_range():
    with pytest.raises(InvalidRequestError, match="ignore_eos"):
        SamplingParams(ignore_eos="yes")
    SamplingParams(seed=2**63 - 1)
    with pytest.raises(InvalidRequestError, match="seed"):
        SamplingParams(seed=2**63)
    with pytest.raises(InvalidRequestError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[-1])


def test_lists_and_strings_are_bounded_and_huge_values_not_echoed():
    from pagedserve.request_limits import (
        MAX_ALLOWED_TOKEN_IDS,
        MAX_BAD_WORD_CHARS,
        MAX_BAD_WORDS,
        MAX_STOP_STRING_CHARS,
        MAX_STOP_STRINGS,
        MAX_TOKEN_ID_LIST,
    )

    SamplingParams(stop=["x"] * MAX_STOP_STRINGS, stop_token_ids=list(range(MAX_TOKEN_ID_LIST)),
                   logit_bias=dict.fromkeys(range(MAX_TOKEN_ID_LIST), 1.0),
                   allowed_token_ids=list(range(MAX_ALLOWED_TOKEN_IDS)),
                   bad_words=["w" * MAX_BAD_WORD_CHARS] * MAX_BAD_WORDS).validate()
    SamplingParams(stop="y" * MAX_STOP_STRING_CHARS).validate()
    SamplingParams(allowed_token_ids=[7, 8, 7]).validate()  # (a repeated id, as vLLM takes it: within the bound)
    for kwargs, param in (({"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, "stop"),
                          ({"stop": "y" * 1_000_000}, "stop"),
                          ({"stop_token_ids": list(range(MAX_TOKEN_ID_LIST + 1))}, "stop_token_ids"),
                          ({"logit_bias": dict.fromkeys(range(49_152), 1.0)}, "logit_bias"),
                          ({"allowed_token_ids": [7] * 1_000_000}, "allowed_token_ids"),
                          ({"bad_words": ["w"] * (MAX_BAD_WORDS + 1)}, "bad_words"),
                          ({"bad_words": ["w" * 9_600]}, "bad_words")):
        with pytest.raises(InvalidRequestError) as info:
            SamplingParams(**kwargs).validate()
        assert info.value.param == param
        assert len(str(info.value)) < 400  # the message names the limit without echoing a megabyte


def test_a_prediction_is_refused_by_name_where_its_drafts_could_not_be_verified_exactly():
    SamplingParams(prediction="def f():\n    return 1\n", temperature=0.7, seed=3, logprobs=2, min_tokens=2)
    SamplingParams(prediction=[1, 2, 3])
    assert SamplingParams().allows_speculation and SamplingParams(prediction="x").allows_speculation
    for kwargs, names in (({"n": 2}, "n = 1"), ({"presence_penalty": 0.5}, "presence_penalty"),
                          ({"frequency_penalty": -0.5}, "frequency_penalty"),
                          ({"repetition_penalty": 1.1}, "repetition_penalty"),
                          ({"logit_bias": {5: 1.0}}, "logit_bias"), ({"allowed_token_ids": [5]}, "allowed_token_ids"),
                          ({"bad_words": ["no"]}, "bad_words"),
                          ({"structured_outputs": StructuredOutputsParams(regex="a+")}, "structured outputs")):
        assert not SamplingParams(**kwargs).allows_speculation or names == "n = 1"
        with pytest.raises(InvalidRequestError, match=names) as info:
            SamplingParams(prediction="x", **kwargs)
        assert info.value.param == "prediction"
    for bad in (5, {"type": "content"}, [1, "2"], [True], [-1]):
        with pytest.raises(InvalidRequestError) as info:
            SamplingParams(prediction=bad)
        assert info.value.param == "prediction"


def test_vllms_normal_forms_stop_as_a_list_and_seed_minus_one_as_none():
    """A lone stop string is a one-string list (`for s in params.stop` goes over strings,
    not characters), no stop an empty list, and seed -1 no seed (random), as vLLM has them."""
    assert SamplingParams(stop="###").stop == ["###"] and SamplingParams().stop == []
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"] and SamplingParams(stop=["x"]).stop == ["x"]
    assert SamplingParams(seed=-1).seed is None and SamplingParams(seed=-2).seed == -2
    assert SamplingParams(seed=0).seed == 0


def test_vllms_older_guided_decoding_and_clone():
    from pagedserve.sampling_params import GuidedDecodingParams

    p = SamplingParams(guided_decoding=GuidedDecodingParams(regex="[ab]+"), stop="x")
    assert p.structured_outputs == StructuredOutputsParams(regex="[ab]+")
    with pytest.raises(InvalidRequestError, match="not both") as info:
        SamplingParams(guided_decoding=GuidedDecodingParams(regex="a"),
                       structured_outputs=StructuredOutputsParams(regex="b"))
    assert info.value.param == "guided_decoding"
    c = p.clone()
    assert c == p and c.stop is not p.stop and c.structured_outputs is not p.structured_outputs


def test_a_structural_tag_that_is_not_an_object_is_refused_at_construction():
    """structural_tag=5 was accepted here and refused only when its grammar compiled."""
    with pytest.raises(InvalidRequestError, match="structural_tag must be a JSON object"):
        SamplingParams(structured_outputs=StructuredOutputsParams(structural_tag=5))
    SamplingParams(structured_outputs=StructuredOutputsParams(structural_tag={"type": "structural_tag"}))


def test_vllms_other_keyword_arguments_run_at_a_neutral_value_or_are_named():
    """SamplingParams(spaces_between_special_tokens=False) and BeamSearchParams(temperature=0.0),
    as vLLM scripts write them, run; another value is refused by name, and a name vLLM lacks
    too gets the valid ones (all were a bare dataclass TypeError)."""
    from pagedserve.sampling_params import BeamSearchParams

    assert SamplingParams(detokenize=True, spaces_between_special_tokens=False, max_tokens=3).max_tokens == 3
    assert BeamSearchParams(beam_width=2, max_tokens=5, temperature=0.0, include_stop_str_in_output=False).beam_width == 2
    with pytest.raises(InvalidRequestError, match="not supported here: no custom logits processors"):
        SamplingParams(logits_processors=[print])
    with pytest.raises(InvalidRequestError, match="not supported here: it must be true or false"):
        SamplingParams(spaces_between_special_tokens="x")
    with pytest.raises(TypeError, match="unexpected keyword argument 'frobnicate'; its arguments are n, "):
        SamplingParams(frobnicate=1)
    with pytest.raises(InvalidRequestError, match="ignore_eos must be true or false"):
        BeamSearchParams(beam_width=2, max_tokens=5, ignore_eos="no").validate(20)
    # best_of equal to n is what the server takes too (it was refused as "best_of > n")
    assert SamplingParams(n=2, best_of=2).n == 2 and SamplingParams(best_of=1).n == 1
    for best_of, n in ((3, 2), (2, 1), (2.0, 2)):
        with pytest.raises(InvalidRequestError, match="best_of must equal n") as e:
            SamplingParams(n=n, best_of=best_of)
        assert e.value.param == "best_of"
    # (nan, inf: every beam's score was nan, or -0.0; 1000, -1000: the length's power
    # overflowed, or reached 0, after the whole search)
    for penalty in (float("nan"), float("inf"), -float("inf"), 1000, -1000, 10.5):
        with pytest.raises(InvalidRequestError, match=r"length_penalty must be a number in \[-10.0, 10.0\]"):
            BeamSearchParams(beam_width=2, max_tokens=5, length_penalty=penalty).validate(20)


@pytest.mark.parametrize(("field", "value"), [("temperature", 1e39), ("repetition_penalty", 1e-50),
                                               ("repetition_penalty", 1e31)])
def test_values_float32_sampling_cannot_hold_are_refused_by_name(field, value) -> None:
    """A temperature past float32's range was inf in the sampler (the logits NaN: a token
    past the vocabulary, a dead engine with logprobs); a repetition penalty of 1e-50 was 0
    (non-finite logits: a 500 blaming the model)."""
    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams(**{field: value})
    SamplingParams(temperature=3e38, repetition_penalty=1e-30)

"""Structured outputs on the default real model as it runs by default: 16 chats (all in flight together) under a
nested JSON schema, greedy and sampled, every answer valid; regex and choice outputs exact."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.sampling_params import StructuredOutputsParams

PERSON = {
    "type": "object",
    "required": ["name", "age", "role", "skills", "address"],
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 24},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "role": {"enum": ["engineer", "doctor", "teacher", "artist"]},
        "skills": {"type": "array", "minItems": 1, "maxItems": 3,
                   "items": {"type": "string", "maxLength": 16}},
        "address": {"type": "object", "required": ["city", "zip"],
                    "properties": {"city": {"type": "string", "maxLength": 20},
                                   "zip": {"type": "integer", "minimum": 10000, "maximum": 99999}},
                    "additionalProperties": False},
    },
    "additionalProperties": False,
}
TOPICS = ["a chef from Lyon", "a retired pilot", "a young painter", "a marine biologist",
          "a school teacher in Oslo", "a software engineer", "a surgeon", "a street musician"]


@pytest.fixture(scope="module")
def llm(smollm2_path) -> LLM:
    return LLM("smollm2-135m-instruct", max_num_seqs=64, max_model_len=512)  # as it runs by default


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_16_chats_under_a_nested_schema_are_all_valid(llm, temperature) -> None:
    # 16, two per topic, all in one batch (64 cost 90 s of the suite on two cores).
    conversations = [[{"role": "user", "content": f"Describe {TOPICS[i % len(TOPICS)]} as JSON (variant {i})."}]
                     for i in range(16)]
    params = SamplingParams(temperature=temperature, seed=7, max_tokens=200,
                            structured_outputs=StructuredOutputsParams(json=PERSON))
    outputs = llm.chat(conversations, params, use_tqdm=False)
    assert len(outputs) == 16
    for out in outputs:
        c = out.outputs[0]
        assert c.finish_reason == "stop", (c.finish_reason, c.text)
        jsonschema.validate(json.loads(c.text), PERSON)
    stats = llm.llm_engine.get_stats()
    assert stats.kv_cache_usage == 0


def test_regex_and_choice_outputs_match_exactly(llm) -> None:
    date = r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])"
    ask = [[{"role": "user", "content": "When did it happen? Answer with a date."}],
           [{"role": "user", "content": "Is the sky green? Answer yes or no."}]]
    params = [SamplingParams(temperature=t, seed=1, max_tokens=40,
                             structured_outputs=StructuredOutputsParams(regex=date)) for t in (0.0, 0.8)]
    for out in llm.chat([ask[0]] * 2, params, use_tqdm=False):
        assert re.fullmatch(date, out.outputs[0].text), out.outputs[0].text
    choice = SamplingParams(temperature=0.8, seed=2, max_tokens=10,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no", "maybe not"]))
    for out in llm.chat([ask[1]] * 4, choice, use_tqdm=False):
        assert out.outputs[0].text in ("yes", "no", "maybe not") and out.outputs[0].finish_reason == "stop"


def test_a_format_complete_before_min_tokens_fails_alone_naming_its_own_constraints(llm) -> None:
    """A choice ends after a token or two; min_tokens=15 forbids ending: no token is left.
    That request fails, its message naming the constraints it set (the runner's message
    lists every kind there is); the one beside it answers."""
    ask = [{"role": "user", "content": "Is the sky green? Answer yes or no."}]
    choice = StructuredOutputsParams(choice=["yes", "no"])
    late = SamplingParams(temperature=0.0, max_tokens=20, min_tokens=15, structured_outputs=choice)
    bad, good = llm.chat([ask, ask], [late, SamplingParams(temperature=0.0, max_tokens=20, structured_outputs=choice)],
                         use_tqdm=False)
    assert bad.outputs[0].finish_reason == "error"
    assert ("this request's: the grammar or response format, min_tokens=15 (which forbids ending before then)"
            in bad.outputs[0].stop_reason)
    assert good.outputs[0].finish_reason == "stop" and good.outputs[0].text in ("yes", "no")

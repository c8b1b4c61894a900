"""The request models: field mapping to SamplingParams, refusals, and error params."""

from __future__ import annotations

import pytest

from pagedserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagedserve.errors import InvalidRequestError

MSGS = [{"role": "user", "content": "hi"}]


def test_chat_maps_openai_names_to_sampling_params():
    req = ChatCompletionRequest(messages=MSGS, max_tokens=5, max_completion_tokens=7, logprobs=True,
                                top_logprobs=3, temperature=0.5, top_k=4, stop="x", seed=1)
    p = req.to_sampling_params()
    assert (p.max_tokens, p.logprobs, p.temperature, p.top_k, p.stop_strings, p.seed) == (7, 3, 0.5, 4, ["x"], 1)
    assert ChatCompletionRequest(messages=MSGS).to_sampling_params().max_tokens is None  # the rest of the context
    assert ChatCompletionRequest(messages=MSGS, logprobs=True).to_sampling_params().logprobs == 0
    assert CompletionRequest(prompt="x").to_sampling_params().max_tokens == 16  # the legacy endpoint's default


def test_errors_name_the_field_the_client_sent():
    with pytest.raises(InvalidRequestError) as e:
        ChatCompletionRequest(messages=MSGS, max_completion_tokens=0).to_sampling_params()
    assert e.value.param == "max_completion_tokens"
    with pytest.raises(InvalidRequestError) as e:
        ChatCompletionRequest(messages=MSGS, max_tokens=0).to_sampling_params()
    assert e.value.param == "max_tokens"
    with pytest.raises(InvalidRequestError) as e:
        ChatCompletionRequest(messages=MSGS, logprobs=True, top_logprobs=-1).to_sampling_params()
    assert e.value.param == "top_logprobs"
    with pytest.raises(InvalidRequestError) as e:
        ChatCompletionRequest(messages=MSGS, top_logprobs=2).to_sampling_params()
    assert e.value.param == "top_logprobs" and "requires logprobs" in str(e.value)
    req = ChatCompletionRequest(messages=MSGS)
    assert req.api_param("prompt") == "messages" and req.api_param("temperature") == "temperature"
    assert CompletionRequest(prompt="x").api_param("prompt") == "prompt"


@pytest.mark.parametrize("field,value", [
    ("response_format", {"type": "json_object"}), ("guided_json", {}), ("guided_choice", ["a"]),
    ("structured_outputs", {"regex": "a"}), ("chat_template_kwargs", {"x": 1}), ("tools", [{"type": "function"}]),
    ("tool_choice", "required"), ("continue_final_message", True), ("logit_bias", {"1": 2.0}),
    ("bad_words", ["x"]), ("allowed_token_ids", [1]), ("prompt_logprobs", 1), ("cache_salt", "s"),
])
def test_fields_that_would_change_the_output_are_refused(field, value):
    with pytest.raises(InvalidRequestError) as e:
        ChatCompletionRequest(messages=MSGS, **{field: value}).check_unsupported()
    assert e.value.param == field


def test_harmless_fields_pass():
    ChatCompletionRequest(messages=MSGS, response_format={"type": "text"}, tool_choice="none", user="u",
                          some_future_field=1).check_unsupported()
    with pytest.raises(InvalidRequestError, match="stream_options can only be set"):
        CompletionRequest(prompt="x", stream_options={"include_usage": True}).check_unsupported()
    with pytest.raises(InvalidRequestError, match="best_of"):
        CompletionRequest(prompt="x", n=1, best_of=2).check_unsupported()

"""OpenAI's Predicted Outputs through the real server and the official `openai` client:
`prediction=` gives the output it would without, with the accepted/rejected counts in
usage, on a server with speculation off (the prediction is its own draft source) and
on one with the defaults (n-gram on); and the refusals, each naming `prediction`."""

from __future__ import annotations

import openai
import pytest
from conftest import API_KEY, MODEL_NAME, SERVER_FLAGS, ServerProcess

MESSAGES = [{"role": "user", "content": "the quick brown fox jumps over the lazy dog. hello world"}]


@pytest.fixture(scope="module")
def server_off(tiny_model_dir, tmp_path_factory):
    proc = ServerProcess([str(tiny_model_dir), *SERVER_FLAGS, "--speculative-config", "off"],
                         tmp_path_factory.mktemp("log") / "server.log")
    yield proc
    proc.stop()


@pytest.fixture(params=["speculation-off", "defaults"])
def client(request, server, server_off) -> openai.OpenAI:
    url = (server_off if request.param == "speculation-off" else server).url
    return openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def chat(client: openai.OpenAI, **kw):
    extra_body = {"ignore_eos": True, **kw.pop("extra_body", {})}
    return client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, temperature=0, max_tokens=40,
                                          extra_body=extra_body, **kw)


def test_prediction_gives_the_same_output_with_its_counts_in_usage(client) -> None:
    want = chat(client).choices[0].message.content
    assert want
    exact = chat(client, prediction={"type": "content", "content": want})
    assert exact.choices[0].message.content == want
    details = exact.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 10, details
    # An edited prediction (a word changed, a line added): still the same output.
    words = want.split(" ")
    words[len(words) // 2] = "zebra"
    edited = chat(client, prediction={"type": "content", "content": [{"type": "text", "text": "new line\n"},
                                                                      {"type": "text", "text": " ".join(words)}]})
    assert edited.choices[0].message.content == want
    assert edited.usage.completion_tokens_details.rejected_prediction_tokens > 0
    # Streamed, usage at the end; and the legacy completions route (prediction as an extra).
    chunks = list(chat(client, prediction={"type": "content", "content": want}, stream=True,
                       stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens_details.accepted_prediction_tokens > 10
    plain = client.completions.create(model=MODEL_NAME, prompt="hello world", temperature=0, max_tokens=30,
                                      extra_body={"ignore_eos": True})
    predicted = client.completions.create(model=MODEL_NAME, prompt="hello world", temperature=0, max_tokens=30,
                                          extra_body={"ignore_eos": True, "prediction": {
                                              "type": "content", "content": plain.choices[0].text}})
    assert predicted.choices[0].text == plain.choices[0].text
    assert predicted.usage.completion_tokens_details.accepted_prediction_tokens > 5
    assert plain.usage.completion_tokens_details is None  # no prediction: usage keeps its shape


@pytest.mark.parametrize("kwargs", [
    {"n": 2}, {"presence_penalty": 0.5}, {"logit_bias": {"5": 3}},
    {"response_format": {"type": "json_object"}},
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
     "tool_choice": "required"},
    {"prediction": {"type": "content", "content": "x" * 300_000}},
    # Within the character bound (max_model_len 256 times the longest token), but more
    # tokens than max_model_len: a character a token.
    {"prediction": {"type": "content", "content": "~^" * 300}},
    {"prediction": {"type": "text", "content": "x"}},
    {"prediction": {"type": "content", "content": [{"type": "image_url"}]}},
    # (a text part's other key: dropped, where a message's text part refuses it)
    {"prediction": {"type": "content", "content": [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}]}},
])
def test_refused_by_name(server_off, kwargs) -> None:
    client = openai.OpenAI(base_url=server_off.url + "/v1", api_key=API_KEY, max_retries=0)
    kwargs.setdefault("prediction", {"type": "content", "content": "hello"})
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, **kwargs)
    assert info.value.body["param"] == "prediction", info.value.body


def test_openai_fields_are_accepted_or_refused_never_only_logged(server) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
    base = chat(client).choices[0].message.content
    got = chat(client, reasoning_effort="low", verbosity="low", service_tier="auto", store=False,
               metadata={"ticket": "T-1"}, modalities=["text"], prompt_cache_key="k-1", prompt_cache_retention="24h",
               safety_identifier="user-1", extra_body={"echo": False})  # (vLLM's default: asks for nothing)
    assert got.choices[0].message.content == base
    warned = [line for line in server.log().splitlines() if "ignoring unknown request field" in line]
    assert not any(name in line for line in warned for name in ("reasoning_effort", "verbosity", "service_tier",
                                                                 "metadata", "modalities", "'store'", "prompt_cache",
                                                                 "safety_identifier"))
    for kwargs, param in (({"modalities": ["text", "audio"]}, "modalities"), ({"store": True}, "store"),
                          ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
                          ({"safety_identifier": "u" * 200}, "safety_identifier"),
                          ({"web_search_options": {}}, "web_search_options"),
                          ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
                          ({"reasoning_effort": "extreme"}, "reasoning_effort"),
                          # (Responses' stored prompt, sent to chat: it was named "messages", engine's
                          # "prompt" renamed as chat spells it)
                          ({"extra_body": {"prompt": {"id": "pmpt_1"}}}, "prompt")):
        with pytest.raises(openai.BadRequestError) as info:
            chat(client, **kwargs)
        assert info.value.body["param"] == param, info.value.body
        assert param in info.value.body["message"], info.value.body

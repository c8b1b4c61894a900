"""Anthropic's Messages API through the official `anthropic` client against the real
server (the session's tiny model): plain, streamed, a forced tool call and its
tool_result sent back, count_tokens, and errors in Anthropic's shape."""

from __future__ import annotations

import functools

import httpx
import openai
import pytest
from conftest import API_KEY, MODEL_NAME

from tests.lazy_module import LazyModule

anthropic = LazyModule("anthropic")

WEATHER = {"name": "get_weather", "description": "Current weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                            "required": ["city"], "additionalProperties": False}}
ASK = [{"role": "user", "content": "What is the capital of France?"}]
T0 = {"temperature": 0}  # (the anthropic 2.x client has no temperature argument; the API still takes it)


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=60)


def test_plain_and_streamed_answers_equal_the_chat_api(server, client) -> None:
    r = client.messages.create(model=MODEL_NAME, max_tokens=12, messages=ASK, extra_body=T0,
                               system="Answer briefly.")
    assert r.type == "message" and r.role == "assistant" and r.model == MODEL_NAME and r.id.startswith("msg")
    assert r._request_id.startswith("req_")  # (Anthropic's request-id header, which users log)
    assert [b.type for b in r.content] == ["text"] and r.stop_reason in ("max_tokens", "end_turn")
    assert 1 <= r.usage.output_tokens <= 12
    chat = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0).chat.completions.create(
        model=MODEL_NAME, max_tokens=12, temperature=0,
        messages=[{"role": "system", "content": "Answer briefly."}, *ASK])
    assert r.content[0].text == chat.choices[0].message.content
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == chat.usage.prompt_tokens

    with client.messages.stream(model=MODEL_NAME, max_tokens=12, messages=ASK, extra_body=T0,
                                system="Answer briefly.") as stream:
        events = list(stream)
        kinds = [event.type for event in events]
        final = stream.get_final_message()
    start = next(e for e in events if e.type == "message_start").message.usage  # (said once the first token came)
    assert (start.input_tokens, start.cache_read_input_tokens) == (final.usage.input_tokens,
                                                                    final.usage.cache_read_input_tokens)
    assert final.content[0].text == r.content[0].text and final.stop_reason == r.stop_reason
    # The same usage streamed: the prompt (cached now) split into input and cache reads
    assert (final.usage.output_tokens, final.usage.input_tokens + final.usage.cache_read_input_tokens) == \
        (r.usage.output_tokens, chat.usage.prompt_tokens)
    assert final.usage.cache_read_input_tokens > 0
    raw = [k for k in kinds if k not in ("text",)]  # the SDK adds "text" helper events
    assert raw[0] == "message_start" and raw[1] == "content_block_start" and raw[-2:] == ["message_delta", "message_stop"]
    assert "content_block_stop" in raw

    counted = client.messages.count_tokens(model=MODEL_NAME, messages=ASK, system="Answer briefly.")
    assert counted.input_tokens == chat.usage.prompt_tokens


def test_a_final_assistant_turn_is_continued(server, client) -> None:
    """Anthropic's prefill: the answer picks up where the final assistant text ends, and
    holds only what follows (as chat's continue_final_message gives it)."""
    prefill = "The capital of France is"
    r = client.messages.create(model=MODEL_NAME, max_tokens=8, extra_body=T0,
                               messages=[*ASK, {"role": "assistant", "content": prefill}])
    chat = httpx.post(server.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                      timeout=60, json={"model": MODEL_NAME, "max_tokens": 8, "temperature": 0,
                                        "messages": [*ASK, {"role": "assistant", "content": prefill}],
                                        "continue_final_message": True, "add_generation_prompt": False}).json()
    assert r.content[0].text == chat["choices"][0]["message"]["content"]
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == chat["usage"]["prompt_tokens"]


def test_models_list_and_retrieve_in_anthropics_shape(client) -> None:
    """/v1/models serves both APIs: Anthropic's client gets its ModelInfo fields."""
    import datetime

    page = client.models.list()
    assert [m.id for m in page.data] == [MODEL_NAME] and page.has_more is False
    assert page.first_id == page.last_id == MODEL_NAME
    one = client.models.retrieve(MODEL_NAME)
    assert one.type == "model" and one.display_name == MODEL_NAME
    assert isinstance(one.created_at, datetime.datetime) and one.created_at.tzinfo is not None
    with pytest.raises(anthropic.NotFoundError):
        client.models.retrieve("no-such-model")


def test_stop_sequences_end_with_stop_sequence(client) -> None:
    free = client.messages.create(model=MODEL_NAME, max_tokens=16, messages=ASK, extra_body=T0)
    text = free.content[0].text
    assert len(text) >= 6, f"the tiny model answered {text!r}: nothing to stop on"
    stop = text[3:6]
    r = client.messages.create(model=MODEL_NAME, max_tokens=16, messages=ASK, extra_body=T0, stop_sequences=[stop])
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop
    assert "".join(b.text for b in r.content) == text[:text.index(stop)]


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_tool_call_and_its_result_sent_back(client, stream: bool) -> None:
    kwargs = dict(model=MODEL_NAME, max_tokens=48, extra_body=T0, tools=[WEATHER],
                  tool_choice={"type": "tool", "name": "get_weather"},
                  messages=[{"role": "user", "content": "Weather in Paris?"}])
    if stream:
        with client.messages.stream(**kwargs) as s:
            kinds = [e.type for e in s]
            r = s.get_final_message()
        assert "content_block_start" in kinds and "input_json" in kinds  # the SDK's name for input_json_delta
    else:
        r = client.messages.create(**kwargs)
    (block,) = [b for b in r.content if b.type == "tool_use"]
    assert block.name == "get_weather" and isinstance(block.input.get("city"), str) and block.id.startswith("toolu_")
    assert r.stop_reason in ("tool_use", "max_tokens")
    follow = client.messages.create(model=MODEL_NAME, max_tokens=8, extra_body=T0, tools=[WEATHER], messages=[
        *kwargs["messages"], {"role": "assistant", "content": r.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id, "content": "sunny, 21 C"}]}],
        tool_choice={"type": "none"})
    assert follow.content and follow.content[0].type == "text"
    # The tool result reached the prompt.
    with_result = client.messages.count_tokens(model=MODEL_NAME, tools=[WEATHER], messages=[
        *kwargs["messages"], {"role": "assistant", "content": r.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id,
                                      "content": "sunny, 21 C " * 20}]}])
    assert with_result.input_tokens > follow.usage.input_tokens + follow.usage.cache_read_input_tokens + 20


def test_output_config_format_constrains_the_answer_to_the_schema(client) -> None:
    import json

    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 8}},
              "required": ["capital"], "additionalProperties": False}
    r = client.messages.create(model=MODEL_NAME, max_tokens=40, messages=ASK, extra_body=T0,
                               output_config={"format": {"type": "json_schema", "schema": schema}, "effort": "low"})
    if r.stop_reason != "max_tokens":
        assert set(json.loads(r.content[0].text)) == {"capital"}
    else:
        assert r.content[0].text.startswith('{"capital"') or r.content[0].text.startswith('{ "capital"')
    with pytest.raises(anthropic.BadRequestError, match="output_config"):
        client.messages.create(model=MODEL_NAME, max_tokens=4, messages=ASK,
                               output_config={"format": {"type": "regex", "pattern": "a+"}})


def test_fields_of_the_other_apis_are_logged_or_refused_not_dropped_silently(server, client) -> None:
    """A field no API here defines is logged as unknown on /v1/messages; vLLM's
    use_beam_search, which asks for a search this route does not run, is refused by name
    as on /v1/responses (it was logged and the answer sampled)."""
    client.messages.create(model=MODEL_NAME, max_tokens=2, messages=ASK, extra_body={"zz_unknown": True})
    assert any("ignoring unknown request field" in line and "'zz_unknown'" in line
               for line in server.log().splitlines())
    with pytest.raises(anthropic.BadRequestError, match="use_beam_search"):
        client.messages.create(model=MODEL_NAME, max_tokens=2, messages=ASK, extra_body={"use_beam_search": True})
    # ...while one this route refuses by name is only refused (the log said it was ignored)
    mark = server.log_mark()
    with pytest.raises(anthropic.BadRequestError, match="container"):
        client.messages.create(model=MODEL_NAME, max_tokens=2, messages=ASK, extra_body={"container": "c1"})
    assert not any("ignoring unknown request field" in line and "'container'" in line
                   for line in server.log_since(mark).splitlines())


@pytest.mark.parametrize("fields, name", [
    ({"cache_control": {"type": "forever"}}, "cache_control"), ({"speed": "warp"}, "speed"),
    ({"output_config": {"effort": "ultra"}}, "output_config"), ({"extra_body": {"workspace_id": 5}}, "workspace_id"),
    ({"output_config": {"format": {"type": "grammar"}}}, "output_config"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "bogus": 1}]}]}, "bogus"),
    ({"messages": [{"role": "user", "content": "hi", "name": "bob"}]}, r"messages\.0\.name"),  # (it was dropped)
])
def test_count_tokens_checks_what_messages_checks(client, fields, name) -> None:
    """count_tokens takes the fields the client's count_tokens sends, checked as
    /v1/messages checks them (each was counted, and logged as unknown)."""
    body = {"model": MODEL_NAME, "messages": ASK, **fields}
    for route in (client.messages.count_tokens, functools.partial(client.messages.create, max_tokens=2)):
        with pytest.raises(anthropic.BadRequestError, match=name):
            route(**body)


def test_errors_come_in_anthropics_shape(server, client) -> None:
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL_NAME, max_tokens=8, extra_body={"temperature": -1.0}, messages=ASK)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert "temperature" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match="image"):
        client.messages.create(model=MODEL_NAME, max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    with pytest.raises(anthropic.BadRequestError, match="thinking"):
        client.messages.create(model=MODEL_NAME, max_tokens=8, messages=ASK,
                               thinking={"type": "enabled", "budget_tokens": 1024})
    with pytest.raises(anthropic.BadRequestError, match="needs a thinking model"):  # (counted: 200)
        client.messages.count_tokens(model=MODEL_NAME, messages=ASK, thinking={"type": "adaptive"})
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="no-such-model", max_tokens=8, messages=ASK)
    assert e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL_NAME, max_tokens=8, messages=ASK)
    assert e.value.body["error"]["type"] == "authentication_error" and e.value.request_id.startswith("req_")
    # A body the schema refuses (max_tokens missing), and a prompt past the context.
    r = httpx.post(server.url + "/v1/messages", headers={"x-api-key": API_KEY},
                   json={"model": MODEL_NAME, "messages": ASK})
    assert r.status_code == 400 and r.json()["type"] == "error" and "max_tokens" in r.json()["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match="context length"):
        client.messages.create(model=MODEL_NAME, max_tokens=10_000, messages=ASK)
    # The OpenAI routes keep OpenAI's shape.
    r = httpx.post(server.url + "/v1/chat/completions", headers={"x-api-key": API_KEY},
                   json={"model": MODEL_NAME, "messages": ASK, "temperature": -1.0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"

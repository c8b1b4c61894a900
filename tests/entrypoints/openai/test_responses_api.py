"""OpenAI's Responses API through the official `openai` client against the real server
(the session's tiny model): plain and streamed answers equal the chat API's, a function
call and its output sent back, text.format json_schema, and refusals by name."""

from __future__ import annotations

import json
from typing import Literal

import openai
import pytest
from conftest import API_KEY, MODEL_NAME

from pagedserve.entrypoints.openai.serving_engine import OpenAIError

WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                          "required": ["city"], "additionalProperties": False}}
ASK = "What is the capital of France?"


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def test_plain_and_streamed_answers_equal_the_chat_api(client) -> None:
    r = client.responses.create(model=MODEL_NAME, input=ASK, instructions="Answer briefly.", max_output_tokens=12,
                                temperature=0)
    assert r.object == "response" and r.id.startswith("resp") and r.status in ("completed", "incomplete")
    assert [item.type for item in r.output] == ["message"] and r.output_text
    assert 1 <= r.usage.output_tokens <= 12 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    from openai.types.responses import Response

    Response.model_validate(r.model_dump())  # (every field the SDK's types require: cache_write_tokens was missing)
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"
    chat = client.chat.completions.create(model=MODEL_NAME, max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": "Answer briefly."}, {"role": "user", "content": ASK}])
    assert r.output_text == chat.choices[0].message.content and r.usage.input_tokens == chat.usage.prompt_tokens

    # A list of input items says the same.
    items = client.responses.create(model=MODEL_NAME, instructions="Answer briefly.", max_output_tokens=12,
                                    temperature=0, input=[{"role": "user", "content": [
                                        {"type": "input_text", "text": ASK}]}])
    assert items.output_text == r.output_text

    with client.responses.stream(model=MODEL_NAME, input=ASK, instructions="Answer briefly.", max_output_tokens=12,
                                 temperature=0) as stream:
        streamed = list(stream)
    kinds, final = [event.type for event in streamed], streamed[-1].response
    assert final.output_text == r.output_text and final.usage.output_tokens == r.usage.output_tokens
    # The last event names how it ended: response.completed, or response.incomplete when
    # max_output_tokens cut it (the SDK's get_final_response() wants the former only)
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == f"response.{r.status}"
    assert "response.output_text.delta" in kinds and "response.output_item.done" in kinds

    cut = client.responses.create(model=MODEL_NAME, input="Write a long story.", max_output_tokens=3, temperature=0)
    assert (cut.status, cut.incomplete_details.reason, cut.output[0].status) == \
        ("incomplete", "max_output_tokens", "incomplete")
    assert cut.completed_at is None
    assert r.status != "completed" or r.completed_at >= r.created_at
    with client.responses.stream(model=MODEL_NAME, input="Write a long story.", max_output_tokens=3,
                                 temperature=0) as stream:
        streamed = list(stream)
    assert streamed[-1].type == "response.incomplete" and streamed[-1].response.output[0].status == "incomplete"
    done = [e.item.status for e in streamed if e.type == "response.output_item.done"]
    assert done == ["incomplete"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_function_call_and_its_output_sent_back(client, stream: bool) -> None:
    kwargs = dict(model=MODEL_NAME, input=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER],
                  tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=48, temperature=0)
    if stream:
        with client.responses.stream(**kwargs) as s:
            kinds = [e.type for e in s]
            r = s.get_final_response()
        assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    else:
        r = client.responses.create(**kwargs)
    (call,) = [item for item in r.output if item.type == "function_call"]
    assert call.name == "get_weather" and isinstance(json.loads(call.arguments)["city"], str)
    follow = client.responses.create(model=MODEL_NAME, tools=[WEATHER], max_output_tokens=8, temperature=0, input=[
        *kwargs["input"], {"type": "function_call", "call_id": call.call_id, "name": call.name,
                           "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C " * 10}], tool_choice="none")
    assert follow.output and follow.output[0].type == "message"
    assert follow.usage.input_tokens > r.usage.input_tokens + 30  # the call and its output reached the prompt


def test_text_format_json_schema_constrains_the_answer(client) -> None:
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 8}},
              "required": ["capital"], "additionalProperties": False}
    r = client.responses.create(model=MODEL_NAME, input=ASK, max_output_tokens=40, temperature=0,
                                text={"format": {"type": "json_schema", "name": "answer", "schema": schema}})
    assert r.status == "completed", r
    assert set(json.loads(r.output_text)) == {"capital"}


@pytest.mark.parametrize("fields, param", [
    ({"store": True}, "store"), ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"tools": [{"type": "web_search"}]}, "tools"), ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"include": ["reasoning.encrypted_content", "reasoning.everything"]}, "include"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input"),
    ({"text": {"format": {"type": "regex"}}}, "text"), ({"text": {"format": True}}, "text"),
    ({"temperature": -1.0}, "temperature"),
    ({"max_output_tokens": 100_000}, "max_output_tokens"),
    # OpenAI's fields for what this server has nothing behind, and hints out of OpenAI's shapes
    ({"conversation": "conv_1"}, "conversation"), ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"context_management": [{"type": "compaction"}]}, "context_management"),
    ({"reasoning": {"effort": "bogus"}}, "reasoning"), ({"reasoning": {"depth": "low"}}, "reasoning"),
    ({"text": {"verbosity": "loud"}}, "text"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {}, "strict": "yes"}}}, "text"),
    ({"stream_options": {"include_obfuscation": False}}, "stream_options"),
    ({"safety_identifier": "u" * 200}, "safety_identifier"),
    ({"image": {"context_compression": "enabled"}}, "image"), ({"access_programs": {"cyber": "daybreak_red"}},
                                                              "access_programs"),
    ({"prompt_cache_options": {"prewarm": True}}, "prompt_cache_options"),
    ({"stream": True, "stream_options": {"include_obfuscation": "yes"}}, "stream_options"),
    # a translation error names the Responses field, not chat's
    ({"tools": [{"type": "function", "name": "f", "parameters": "x"}]}, "tools"),
    # vLLM's fields for what this server does not do (they were logged and ignored)
    ({"extra_body": {"request_id": "mine"}}, "request_id"), ({"extra_body": {"kv_transfer_params": {}}},
                                                             "kv_transfer_params"),
    ({"metadata": {str(i): "v" for i in range(17)}}, "metadata"),  # (OpenAI's bounds, as on chat)
    # Chat Completions' names (OpenAI: "Unsupported parameter"; max_tokens was ignored, the answer ran on)
    ({"extra_body": {"max_tokens": 3}}, "max_tokens"), ({"extra_body": {"max_completion_tokens": 3}},
                                                         "max_completion_tokens"),
    ({"extra_body": {"response_format": {"type": "json_object"}}}, "response_format"),
    ({"extra_body": {"n": 2}}, "n"), ({"extra_body": {"logprobs": True}}, "logprobs"),
    ({"extra_body": {"reasoning_effort": "low"}}, "reasoning_effort"), ({"extra_body": {"verbosity": "low"}}, "verbosity"),
    ({"extra_body": {"messages": [{"role": "user", "content": "hi"}]}}, "messages"),
    # OpenAI's rules on tools and formats (each was accepted)
    ({"tools": [WEATHER, WEATHER]}, "tools"), ({"tools": [{**WEATHER, "name": "bad name!"}]}, "tools"),
    ({"tools": [{**WEATHER, "defer_loading": True}]}, "tools"), ({"tools": [{"type": "function"}]}, "tools"),
    ({"text": {"format": {"type": "json_schema", "name": "has space", "schema": {}}}}, "text"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {}, "foo": 1}}}, "text"),
    ({"input": [{"role": "user", "content": "hi"}, {"type": "function_call_output", "call_id": "c1", "output": "ok"}]},
     "input"),
    # a call with no output (OpenAI: "No tool output found for function call c1."; the model saw it unanswered)
    ({"input": [{"role": "user", "content": "hi"}, {"type": "function_call", "call_id": "c1", "name": "f",
                                                    "arguments": "{}"}, {"role": "user", "content": "and?"}]}, "input"),
])
def test_what_is_not_supported_is_refused_by_name(client, fields, param) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**{"model": MODEL_NAME, "input": ASK, "max_output_tokens": 4, **fields})
    assert e.value.body["param"] == param, e.value.body


def test_hints_are_accepted_without_effect_and_never_only_logged(client, server) -> None:
    """OpenAI's caching, safety and tier hints, reasoning's effort and summary, text's
    verbosity, max_tool_calls (a bound on built-in tools, of which there are none) and
    include's values with nothing to add here:
    the same answer as without them, and none logged as an unknown field."""
    ask = {"model": MODEL_NAME, "input": ASK, "max_output_tokens": 6, "temperature": 0}
    base = client.responses.create(**ask).output_text
    got = client.responses.create(**ask, prompt_cache_key="k-1", prompt_cache_retention="24h", service_tier="ultrafast",
                                  # (what agent clients send with store false; the other values add to items of
                                  # built-in tools, which are refused: nothing to add here)
                                  include=["reasoning.encrypted_content", "file_search_call.results",
                                           "message.input_image.image_url"],
                                  safety_identifier="user-1", max_tool_calls=2, text={"verbosity": "low"},
                                  reasoning={"effort": "max", "summary": "auto", "context": "auto", "mode": "standard"},
                                  prompt_cache_options={"mode": "implicit", "ttl": "12h", "prewarm": False},
                                  image={"context_compression": "auto"}, access_programs={"cyber": "standard"})
    assert got.output_text == base
    # ...and echoed as OpenAI echoes them (service_tier: the tier that served it)
    assert (got.prompt_cache_key, got.prompt_cache_retention, got.safety_identifier, got.max_tool_calls,
            got.service_tier, got.background, got.image.context_compression) == \
        ("k-1", "24h", "user-1", 2, "default", False, "auto")
    warned = [line for line in server.log().splitlines() if "ignoring unknown request field" in line]
    assert not any(name in line for line in warned for name in ("prompt_cache", "safety_identifier", "max_tool_calls",
                                                                 "service_tier", "image", "access_programs"))


def test_the_agents_sdk_runs_an_agent_with_a_function_tool(server) -> None:
    """The OpenAI Agents SDK's default model (Responses): the model must call the tool
    (tool_choice "required", a tiny random model would not choose to), the SDK runs it
    and, told to stop on the first tool, returns its result."""
    import agents  # (openai-agents: a dev dependency, like the openai client itself)
    seen: list[str] = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:  # (a bounded answer for a random model)
        """Current weather of a city."""
        seen.append(city)
        return f"sunny in {city}"

    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    agent = agents.Agent(
        name="weather", instructions="Use the tool.", tools=[get_weather], tool_use_behavior="stop_on_first_tool",
        model=agents.OpenAIResponsesModel(model=MODEL_NAME, openai_client=client),
        model_settings=agents.ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=0,
                                             max_tokens=64))
    agents.set_tracing_disabled(True)
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?")
    assert len(seen) == 1 and result.final_output == f"sunny in {seen[0]}"


def test_vllms_sampling_fields_reach_the_answer(client, server) -> None:
    """vLLM's Responses fields that chat's handler does (seed, stop, top_k, ...) are passed on
    (they were logged as unknown and ignored: a seeded answer differed each time)."""
    ask = {"model": MODEL_NAME, "input": ASK, "max_output_tokens": 12}
    seeded = [client.responses.create(**ask, temperature=1.5, extra_body={"seed": 7}).output_text for _ in range(2)]
    assert seeded[0] == seeded[1]
    whole = client.responses.create(**ask, temperature=0).output_text
    word = whole.split()[1]
    stopped = client.responses.create(**ask, temperature=0, extra_body={"stop": [word]}).output_text
    assert stopped == whole[: whole.index(word)], (whole, stopped)
    warned = [line for line in server.log().splitlines() if "ignoring unknown request field" in line]
    assert not any("'seed'" in line or "'stop'" in line for line in warned)  # (used: not "unknown")
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**{**ask, "max_output_tokens": 0})
    assert e.value.body["param"] == "max_output_tokens" and e.value.body["message"].startswith("max_output_tokens ")


def test_truncation_auto_drops_the_first_items_until_the_conversation_fits(client) -> None:
    """OpenAI's truncation "auto": items from the conversation's start dropped until it fits
    the context (256 tokens here); "disabled" (the default) refuses it; the answer says which."""
    long = [{"role": "user", "content": "word " * 60}, {"role": "assistant", "content": "ok"}]  # (~125 tokens)
    items = [*long, *long, {"role": "user", "content": ASK}]
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=MODEL_NAME, input=items, max_output_tokens=8)
    r = client.responses.create(model=MODEL_NAME, input=items, max_output_tokens=8, truncation="auto", temperature=0)
    assert r.truncation == "auto" and r.status in ("completed", "incomplete")
    assert 100 < r.usage.input_tokens <= 256 - 8  # (the first long turn dropped, the second kept)
    # Past the characters 256 tokens can spell, the conversation is refused before it is
    # tokenized: the same cut answers it (it was a 400 "Cannot apply the chat template").
    many = [*long * 40, {"role": "user", "content": ASK}]
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL_NAME, input=many, max_output_tokens=8)
    assert e.value.body["code"] == "context_length_exceeded" and " characters, more than " in e.value.body["message"]
    r = client.responses.create(model=MODEL_NAME, input=many, max_output_tokens=8, truncation="auto", temperature=0)
    assert r.truncation == "auto" and 100 < r.usage.input_tokens <= 256 - 8
    # No cut makes room for a budget past the context: the refusal names the budget, not the input
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL_NAME, input=ASK, max_output_tokens=300, truncation="auto")
    assert (e.value.body["param"], e.value.body["code"]) == ("max_output_tokens", "context_length_exceeded"), e.value.body


def test_only_the_item_max_output_tokens_cut_is_incomplete() -> None:
    """Calls finished before the cut are completed, as the stream closed them (the final
    response marked every item incomplete, and a client skipping those dropped whole calls)."""
    from pagedserve.entrypoints.openai.protocol_responses import ResponseOutput

    out = ResponseOutput(text="Let me check.", finish_reason="length",
                         calls=[{"call_id": f"c{i}", "name": "f", "arguments": "{}"} for i in range(3)])
    assert [item["status"] for item in out.items()] == ["completed"] * 3 + ["incomplete"]
    out.finish_reason = "stop"
    assert [item["status"] for item in out.items()] == ["completed"] * 4
    assert [item["status"] for item in out.items(done=False)] == ["in_progress"] * 4


def test_the_response_echoes_what_openai_echoes(client) -> None:
    """metadata {} when unset, text.format beside a verbosity alone, a function tool's
    strict (every call's grammar holds to its schema here), reasoning as sent: each was null
    or left out, and clients read them."""
    tool = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}}
    r = client.responses.create(model=MODEL_NAME, input=ASK, max_output_tokens=2, text={"verbosity": "low"},
                                tools=[tool], tool_choice="none", reasoning={"effort": "low"})
    assert r.metadata == {} and r.text.format.type == "text" and r.text.verbosity == "low"
    assert r.tools[0].strict is True and r.reasoning.effort == "low"


@pytest.mark.parametrize("content, match", [
    ([{"type": "input_text", "text": "hi", "bogus": 1}], "'bogus' is not a field of an input_text part"),
    ([{"type": "input_text"}], "an input_text part needs its text"),  # (it said input_text was not supported)
    ([{"type": "input_text", "text": 5}], "needs its text"),
    ([{"type": "input_image", "image_url": "data:image/png;base64,AA==", "file_id": "file_1"}], "file_id"),
])
def test_a_content_parts_keys_are_checked_as_openai_checks_them(content, match) -> None:
    """A key OpenAI does not define for a part is refused by name (it was dropped); an
    image's detail is checked as chat's, a file_id beside its image_url refused (ignored)."""
    from pydantic import ValidationError

    from pagedserve.entrypoints.openai.protocol_responses import ResponsesRequest
    from pagedserve.entrypoints.openai.serving_responses import to_chat_request

    with pytest.raises((OpenAIError, ValidationError), match=match):
        to_chat_request(ResponsesRequest(input=[{"role": "user", "content": content}]))
    image = {"type": "input_image", "image_url": "data:image/png;base64,AA==", "detail": "bogus"}
    chat, _ = to_chat_request(ResponsesRequest(input=[{"role": "user", "content": [image]}]))
    assert chat.messages[0].content[0]["image_url"]["detail"] == "bogus"  # (refused by name where images load)


def test_items_sent_back_keep_their_keys_and_unknown_ones_are_refused(client, server) -> None:
    """An earlier answer's items sent back as the SDK sends them (id, status, phase,
    annotations, logprobs) answer as the bare items do; a key no item defines, or a call
    made by code execution, is a 400 naming it; fields refused by name are not also
    logged as unknown (the log said 'ignoring' what had been refused)."""
    said = {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed", "phase": "final_answer",
            "content": [{"type": "output_text", "text": "Paris.", "annotations": [], "logprobs": []}]}
    bare = {"role": "assistant", "content": "Paris."}
    ask = {"model": MODEL_NAME, "max_output_tokens": 6, "temperature": 0}
    mark = server.log_mark()
    turns = [{"role": "user", "content": ASK}, None, {"role": "user", "content": "And of Italy?"}]
    answers = [client.responses.create(**ask, input=[turns[0], item, turns[2]]).output_text for item in (said, bare)]
    assert answers[0] == answers[1]
    for item, name in (({**said, "bogus": 1}, "'bogus'"),
                       ({"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}",
                         "caller": {"type": "program"}}, "caller")):
        with pytest.raises(openai.BadRequestError, match=name):
            client.responses.create(**ask, input=[turns[0], item])
    with pytest.raises(openai.BadRequestError, match="conversation"):
        client.responses.create(**ask, input=ASK, extra_body={"conversation": "conv_1"})
    client.responses.create(**ask, input=ASK, extra_body={"use_beam_search": False})
    warned = [line for line in server.log_since(mark).splitlines() if "ignoring unknown request field" in line]
    assert not any(name in line for line in warned for name in ("conversation", "use_beam_search"))

"""Structured outputs and tool calls through the real server, with the official client
(the tiny random model writes nonsense, so every check is that the output follows the
constraint it was given)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pydantic
import pytest
from conftest import API_KEY, MODEL_NAME

MESSAGES = [{"role": "user", "content": "hello world"}]
# Bounded strings and arrays: a random model must still be able to finish inside max_tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "colour": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
        "address": {"type": "object", "properties": {"zip": {"type": "integer", "minimum": 1000, "maximum": 9999}},
                    "required": ["zip"]},
    },
    "required": ["name", "age", "colour", "tags", "address"],
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120) as c:
        yield c


def chat(client, **kw):
    return client.chat.completions.create(model=MODEL_NAME, messages=kw.pop("messages", MESSAGES),
                                          max_tokens=kw.pop("max_tokens", 120), **kw)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_json_schema_response_format_is_valid(client, temperature):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    r = chat(client, response_format=fmt, temperature=temperature, seed=3, n=2)
    for choice in r.choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_json_object_and_streaming_with_a_schema(client):
    obj = chat(client, response_format={"type": "json_object"}, temperature=0, max_tokens=200)
    if obj.choices[0].finish_reason == "stop":  # a free JSON object may run past max_tokens
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    pieces = [ch.choices[0].delta.content or "" for ch in
              chat(client, response_format=fmt, temperature=0.5, seed=1, stream=True) if ch.choices]
    jsonschema.validate(json.loads("".join(pieces)), SCHEMA)


def test_regex_choice_and_vllm_spellings(server, client):
    r = chat(client, temperature=0.9, seed=2, extra_body={"structured_outputs": {"regex": "[a-e]{3}-[0-9]{2}"}})
    text = r.choices[0].message.content
    assert len(text) == 6 and text[3] == "-" and set(text[:3]) <= set("abcde") and text[4:].isdigit()
    r = chat(client, temperature=0.9, seed=2, extra_body={"guided_choice": ["yes", "no", "maybe"]})
    assert r.choices[0].message.content in ("yes", "no", "maybe")
    body = {"model": MODEL_NAME, "prompt": "the quick", "max_tokens": 50, "temperature": 0.7,
            "guided_json": {"type": "array", "items": {"type": "integer", "maximum": 9}, "maxItems": 4}}
    text = httpx.post(server.url + "/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"}).json()["choices"][0]["text"]
    assert all(isinstance(x, int) for x in json.loads(text))
    # vLLM's structural_tag in structured_outputs (refused though the engine has it, and another
    # message offered it); a json_schema without its schema is OpenAI's 400, not "any JSON"
    tag = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<n>"], "tags": [
        {"type": "tag", "begin": "<n>", "content": {"type": "json_schema", "json_schema": {"type": "integer"}},
         "end": "</n>"}]}}
    r = chat(client, temperature=0.9, seed=2, max_tokens=40, extra_body={"structured_outputs": {"structural_tag": tag}})
    text = r.choices[0].message.content
    for opened in text.split("<n>")[1:]:  # (free text outside the tag; inside, the schema)
        inner = opened.split("</n>")[0]
        assert "</n>" not in opened or inner.strip().lstrip("-").isdigit(), text
    # ...and as vLLM's response_format of type structural_tag, in either of its forms (a 400)
    older = {"type": "structural_tag", "triggers": ["<n>"],
             "structures": [{"begin": "<n>", "schema": {"type": "integer"}, "end": "</n>"}]}
    for form in (tag, older):
        r = chat(client, temperature=0.9, seed=2, max_tokens=40, extra_body={"response_format": form})
        assert r.choices[0].message.content == text
    with pytest.raises(openai.BadRequestError, match="'schema'"):
        chat(client, response_format={"type": "json_schema", "json_schema": {"name": "x"}})


def test_parse_with_a_pydantic_model(client):
    class Person(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=8)
        age: int = pydantic.Field(ge=0, le=120)
        likes_tea: bool

    r = client.chat.completions.parse(model=MODEL_NAME, messages=MESSAGES, response_format=Person, max_tokens=120,
                                      temperature=0)
    person = r.choices[0].message.parsed
    assert isinstance(person, Person) and 0 <= person.age <= 120


def test_invalid_schema_regex_and_grammar_are_400s(client):
    for extra in ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                               "schema": {"type": "objekt"}}}},
                  {"extra_body": {"guided_regex": "[a-"}},
                  {"extra_body": {"guided_grammar": "root ::= ("}}):
        with pytest.raises(openai.BadRequestError) as e:
            chat(client, **extra)
        field = next(iter(extra["extra_body"])) if "extra_body" in extra else "response_format"
        assert e.value.body["param"] == field, e.value.body
        assert "invalid" in e.value.body["message"]
    assert chat(client, max_tokens=3).choices[0].message.content is not None


def test_a_constraint_the_grammar_library_cannot_follow_is_a_400(server):
    """llguidance's mask for the regex "\x1f0" allows "0", which its matcher then refuses
    (found by the schema fuzzer): the request ends with a 400 that says so, not a 500."""
    r = httpx.post(server.url + "/v1/completions", timeout=60, headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"model": MODEL_NAME, "prompt": "0", "guided_regex": "\x1f0", "max_tokens": 1})
    assert r.status_code == 400 and "grammar refused a token" in r.json()["error"]["message"], r.text


def test_a_grammar_whose_lexer_runs_out_of_fuel_says_why_and_leaves_the_cache(server):
    """Nested repeats compile at once and blow up llguidance's lexer at the first token:
    the 400 carries the library's reason (it said only "refused a token its own mask
    allowed"), and the grammar leaves the cache (its grown lexer was kept, 100-230 MB per
    distinct grammar, and a repeat then answered 200 from it)."""
    body = {"model": MODEL_NAME, "prompt": "K", "max_tokens": 4,
            "guided_grammar": 'root ::= a{1000}\na ::= b{1000}\nb ::= "K"{1000}'}
    before = server.metrics()
    for _ in range(2):
        r = httpx.post(server.url + "/v1/completions", timeout=60, headers={"Authorization": f"Bearer {API_KEY}"},
                       json=body)
        assert r.status_code == 400 and "too many expressions" in r.json()["error"]["message"], r.text
    compiles = ("pagedserve:grammar_compiles_total", ())
    assert server.metrics()[compiles] - before.get(compiles, 0) == 2  # compiled again: not kept


def test_forced_and_required_tool_calls(client):
    named = chat(client, tools=[WEATHER, CLOCK], tool_choice={"type": "function", "function": {"name": "get_time"}},
                 temperature=0.7, seed=5)
    (choice,) = named.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_time" and call.id.startswith("call-")
    jsonschema.validate(json.loads(call.function.arguments), CLOCK["function"]["parameters"])
    required = chat(client, tools=[WEATHER, CLOCK], tool_choice="required", parallel_tool_calls=False,
                    temperature=0.7, seed=6)
    (call,) = required.choices[0].message.tool_calls
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), schema)
    # Streamed, the argument pieces of the named call concatenate to the same kind of JSON.
    chunks = list(chat(client, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}},
                       temperature=0.7, seed=5, stream=True))
    deltas = [tc for ch in chunks if ch.choices and ch.choices[0].delta.tool_calls
              for tc in ch.choices[0].delta.tool_calls]
    assert deltas[0].function.name == "get_weather" and deltas[0].id
    jsonschema.validate(json.loads("".join(d.function.arguments or "" for d in deltas)),
                        WEATHER["function"]["parameters"])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # A delta holds only what it adds (no "type": null on an argument fragment): the openai
    # client's stream helper failed on those with an AssertionError.
    assert all(set(d.model_dump(exclude_unset=True)) <= {"index", "function"} for d in deltas[1:])
    with client.chat.completions.stream(model=MODEL_NAME, messages=MESSAGES, max_tokens=120, tools=[WEATHER],
                                        tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                        temperature=0.7, seed=5) as stream:
        final = stream.get_final_completion()
    (call,) = final.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and call.type == "function"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_a_tool_without_parameters_takes_none_and_a_cut_call_is_not_finished(client):
    """OpenAI: omitting `parameters` defines an empty parameter list (an open schema let the
    model invent arguments, or run to the length limit); a client's stop string that cuts a
    call leaves finish_reason "stop", not "tool_calls" over arguments that do not parse."""
    from pagedserve.entrypoints.openai.tool_parsers import tool_parameters

    assert tool_parameters(None) == tool_parameters({}) == {"type": "object", "properties": {},
                                                            "additionalProperties": False}
    ping = {"type": "function", "function": {"name": "ping"}}
    for choice in ({"type": "function", "function": {"name": "ping"}}, "required"):
        got = chat(client, tools=[ping], tool_choice=choice, temperature=0, max_tokens=40,
                   parallel_tool_calls=False).choices[0]  # (one call: else this model repeats calls to the limit)
        assert got.message.tool_calls, (choice, got)
        for call in got.message.tool_calls:
            assert (call.function.name, json.loads(call.function.arguments)) == ("ping", {}), choice
    named = {"type": "function", "function": {"name": "get_weather"}}
    cut = chat(client, tools=[WEATHER], tool_choice=named, temperature=0, stop=['"']).choices[0]
    assert cut.finish_reason == "stop" and cut.message.tool_calls[0].function.arguments == "{"
    chunks = list(chat(client, tools=[WEATHER], tool_choice=named, temperature=0, stop=['"'], stream=True))
    assert chunks[-1].choices[0].finish_reason == "stop"
    # Logprobs come with a call's tokens streamed as they do whole (they were dropped streamed).
    whole = chat(client, tools=[WEATHER], tool_choice=named, temperature=0, logprobs=True, top_logprobs=1)
    streamed = list(chat(client, tools=[WEATHER], tool_choice=named, temperature=0, logprobs=True, top_logprobs=1,
                         stream=True))
    tokens = [t.token for ch in streamed if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.content]
    assert tokens == [t.token for t in whole.choices[0].logprobs.content] and tokens


def test_a_required_answer_cut_short_keeps_its_whole_calls_and_shows_no_internal_array(client):
    for stream in (False, True):
        kw = {"tools": [WEATHER, CLOCK], "tool_choice": "required", "temperature": 0, "max_tokens": 8}
        if stream:
            chunks = list(chat(client, stream=True, **kw))
            content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
            reason = chunks[-1].choices[0].finish_reason
        else:
            choice = chat(client, **kw).choices[0]
            content, reason = choice.message.content or "", choice.finish_reason
        assert reason == "length" and '{"name"' not in content, (stream, content)


def test_legacy_functions_are_tools(client):
    """OpenAI's deprecated functions/function_call: the same request as tools/tool_choice,
    answered in its own shape (message.function_call, finish_reason "function_call",
    streamed as delta.function_call), and its conversation turns (an assistant's
    function_call, a `function` message) taken as tool turns."""
    r = chat(client, functions=[CLOCK["function"]], function_call={"name": "get_time"}, temperature=0.7, seed=5)
    call = r.choices[0].message.function_call
    assert not r.choices[0].message.tool_calls
    assert call.name == "get_time" and r.choices[0].finish_reason == "function_call"
    jsonschema.validate(json.loads(call.arguments), CLOCK["function"]["parameters"])
    as_tools = chat(client, tools=[CLOCK], tool_choice={"type": "function", "function": {"name": "get_time"}},
                    temperature=0.7, seed=5)
    assert as_tools.choices[0].message.tool_calls[0].function.arguments == call.arguments
    chunks = list(chat(client, functions=[CLOCK["function"]], function_call={"name": "get_time"}, temperature=0.7,
                       seed=5, stream=True))
    deltas = [ch.choices[0].delta.function_call for ch in chunks if ch.choices and ch.choices[0].delta.function_call]
    assert deltas[0].name == "get_time" and "".join(d.arguments or "" for d in deltas) == call.arguments
    assert chunks[-1].choices[0].finish_reason == "function_call"
    follow = client.chat.completions.create(model=MODEL_NAME, max_tokens=4, functions=[CLOCK["function"]], messages=[
        {"role": "user", "content": "time?"},
        {"role": "assistant", "content": None, "function_call": {"name": "get_time", "arguments": call.arguments}},
        {"role": "function", "name": "get_time", "content": "12:00"}])
    tool_turns = client.chat.completions.create(model=MODEL_NAME, max_tokens=4, tools=[CLOCK], messages=[
        {"role": "user", "content": "time?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_get_time", "type": "function", "function": {
            "name": "get_time", "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": "call_get_time", "name": "get_time", "content": "12:00"}])
    assert follow.usage.prompt_tokens == tool_turns.usage.prompt_tokens  # the same rendered prompt
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, functions=[CLOCK["function"]], tools=[WEATHER])
    assert info.value.body["param"] == "functions"
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, functions=[CLOCK["function"]], function_call={"name": "nope"})
    assert info.value.body["param"] == "function_call"


def test_auto_tool_call_then_its_result_fed_back(server, client, tokenizer):
    opener = tokenizer.convert_tokens_to_ids("<tool_call>")
    # The random model is pushed to open a call; the parser's structural tag makes the call valid.
    first = chat(client, tools=[WEATHER], tool_choice="auto", parallel_tool_calls=False, temperature=0,
                 logit_bias={str(opener): 100})
    (choice,) = first.choices
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    second = chat(client, messages=history, tools=[WEATHER], max_tokens=5, temperature=0)
    assert second.choices[0].message.content is not None
    # The tool result and the earlier call are part of the prompt, not dropped.
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + len(tokenizer.encode("sunny, 21 C"))
    shown = httpx.post(server.url + "/tokenize", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60,
                       json={"model": MODEL_NAME, "messages": history, "tools": [WEATHER]}).json()["tokens"]
    prompt = tokenizer.decode(shown)
    assert "get_weather" in prompt and all(str(v) in prompt for v in json.loads(call.function.arguments).values())
    streamed = list(chat(client, tools=[WEATHER], tool_choice="auto", parallel_tool_calls=False, temperature=0,
                         logit_bias={str(opener): 100}, stream=True))
    calls = [tc for ch in streamed if ch.choices and ch.choices[0].delta.tool_calls
             for tc in ch.choices[0].delta.tool_calls]
    assert [c.function.name for c in calls] == ["get_weather"]
    assert json.loads(calls[0].function.arguments) == json.loads(call.function.arguments)


def test_grammar_compiles_and_cache_hits_reach_metrics(server, client):
    def value(m: dict, name: str) -> float:
        return m.get((name, ()), 0.0)

    before = server.metrics()
    for _ in range(2):
        chat(client, temperature=0, max_tokens=8, extra_body={"structured_outputs": {"regex": "[q-v]{4}"}})
    after = server.metrics()
    assert value(after, "pagedserve:grammar_compiles_total") - value(before, "pagedserve:grammar_compiles_total") == 1
    assert value(after, "pagedserve:grammar_cache_hits_total") - value(before, "pagedserve:grammar_cache_hits_total") == 1
    assert value(after, "pagedserve:grammar_compile_seconds_total") > value(before, "pagedserve:grammar_compile_seconds_total")
    assert value(after, "pagedserve:num_requests_structured") == 0

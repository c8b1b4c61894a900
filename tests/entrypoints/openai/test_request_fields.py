"""The rule: every field of the request models either does what OpenAI's / vLLM's docs say
(an effect observable in the response) or is refused with a 400 whose `param` names it.
The table must cover every field: a new field without a decision fails here."""

from __future__ import annotations

import functools
import json

import httpx
import pytest
from conftest import API_KEY, MODEL_NAME

from pagedserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

PROMPT = "the quick brown fox"
MESSAGES = [{"role": "user", "content": "hello world"}]
CONTINUED = {"messages": [*MESSAGES, {"role": "assistant", "content": "The answer"}],
             "continue_final_message": True, "add_generation_prompt": False}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"enum": [1, 2]}}, "required": ["x"]}}}]


def post(server, chat: bool, **fields) -> httpx.Response:
    body = {"model": MODEL_NAME, "temperature": 0, **fields}
    body.setdefault("max_completion_tokens" if "max_completion_tokens" in fields else "max_tokens", 6)
    body.setdefault("messages" if chat else "prompt", MESSAGES if chat else PROMPT)
    return _client().post(server.url + ("/v1/chat/completions" if chat else "/v1/completions"), json=body)


@functools.cache
def _client() -> httpx.Client:
    """One client for the file's ~200 requests (a new one parsed the CA bundle: 20-40 ms of CPU)."""
    return httpx.Client(timeout=60, headers={"Authorization": f"Bearer {API_KEY}"})


def text(r: httpx.Response, i: int = 0) -> str:
    c = r.json()["choices"][i]
    return c["message"]["content"] if "message" in c else c["text"]


def tokens(r: httpx.Response) -> int:
    return r.json()["usage"]["completion_tokens"]


def refused(param: str):
    def check(r, base, tok):
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    return check


def same_as_greedy(r, base, tok):
    assert r.status_code == 200 and text(r) == text(base), (text(r), text(base))


def ok(r, base, tok):
    assert r.status_code == 200, r.text


def differs(r, base, tok):
    assert r.status_code == 200 and text(r) != text(base)


def predicted(r, base, tok):
    """The same output as without the prediction, and the prediction's counts in usage
    (tests/entrypoints/openai/test_prediction_api.py: predictions that are used)."""
    same_as_greedy(r, base, tok)
    details = r.json()["usage"]["completion_tokens_details"]
    assert details["accepted_prediction_tokens"] >= 0 and details["rejected_prediction_tokens"] >= 0, details


def sse_events(r) -> list:
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


# field -> (value(s) to send, check(response, greedy baseline response, tokenizer))
COMMON = {
    "model": ({"model": MODEL_NAME}, ok),
    # vLLM's (default true on completions, false on chat): SmolLM2's tokenizer adds no special
    # tokens, so the prompt is the same (tests/engine/test_special_text.py: one that adds a BOS)
    "add_special_tokens": ({"add_special_tokens": True}, lambda r, b, t: (
        r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == b.json()["usage"]["prompt_tokens"])
        or pytest.fail(r.text)),
    # vLLM's: the answer's id; the engine's own ids stay unique (the same id twice at once is fine)
    "request_id": ({"request_id": "job-7"}, lambda r, b, t: r.json()["id"].endswith("-job-7") or pytest.fail()),
    "max_tokens": ({"max_tokens": 2, "ignore_eos": True}, lambda r, b, t: tokens(r) == 2 or pytest.fail()),
    "temperature": ({"temperature": 0}, same_as_greedy),
    "top_p": ({"temperature": 1.0, "top_p": 1e-9, "seed": 3}, same_as_greedy),
    "top_k": ({"temperature": 1.0, "top_k": 1, "seed": 3}, same_as_greedy),
    "min_p": ({"temperature": 1.0, "min_p": 1.0, "seed": 3}, same_as_greedy),
    "n": ({"n": 3, "temperature": 1.0}, lambda r, b, t: len(r.json()["choices"]) == 3 or pytest.fail()),
    "stop": ({"stop": ["zzzz"]}, same_as_greedy),
    "seed": ({"seed": 11, "temperature": 1.0},
             lambda r, b, t: text(r) == text(post(SERVER[0], CHAT[0], seed=11, temperature=1.0)) or pytest.fail()),
    "presence_penalty": ({"presence_penalty": 2.0, "max_tokens": 20, "ignore_eos": True}, differs),
    "frequency_penalty": ({"frequency_penalty": 2.0, "max_tokens": 20, "ignore_eos": True}, differs),
    "repetition_penalty": ({"repetition_penalty": 3.0, "max_tokens": 20, "ignore_eos": True}, differs),
    "stream": ({"stream": True}, lambda r, b, t: r.text.rstrip().endswith("data: [DONE]") or pytest.fail()),
    "stream_options": ({"stream": True, "stream_options": {"include_usage": True}},
                       lambda r, b, t: sse_events(r)[-1]["usage"] is not None or pytest.fail()),
    "user": ({"user": "someone"}, same_as_greedy),
    "logit_bias": (None, None),  # filled per tokenizer below
    "min_tokens": ({"min_tokens": 5, "max_tokens": 5}, lambda r, b, t: tokens(r) == 5 or pytest.fail()),
    "stop_token_ids": (None, None),
    "ignore_eos": ({"ignore_eos": True, "max_tokens": 30}, lambda r, b, t: tokens(r) == 30 or pytest.fail()),
    "include_stop_str_in_output": (None, None),
    "skip_special_tokens": ({"skip_special_tokens": False}, ok),
    "priority": ({"priority": 1}, refused("priority")),
    "response_format": ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"enum": ["yes", "no"]}}}},
        lambda r, b, t: json.loads(text(r)) in ("yes", "no") or pytest.fail()),
    "structured_outputs": ({"structured_outputs": {"choice": ["left", "right"]}},
                           lambda r, b, t: text(r) in ("left", "right") or pytest.fail()),
    "guided_json": ({"guided_json": {"type": "integer", "minimum": 0, "maximum": 9}},
                    lambda r, b, t: 0 <= json.loads(text(r)) <= 9 or pytest.fail()),
    "guided_regex": ({"guided_regex": "[xyz]{3}"}, lambda r, b, t: set(text(r)) <= set("xyz") or pytest.fail()),
    "guided_choice": ({"guided_choice": ["cat", "dog"]}, lambda r, b, t: text(r) in ("cat", "dog") or pytest.fail()),
    "guided_grammar": ({"guided_grammar": 'root ::= "ab" | "cd"'},
                       lambda r, b, t: text(r) in ("ab", "cd") or pytest.fail()),
    "guided_decoding_backend": ({"guided_decoding_backend": "outlines"}, refused("guided_decoding_backend")),
    "guided_whitespace_pattern": ({"guided_whitespace_pattern": " "}, refused("guided_whitespace_pattern")),
    "prompt_logprobs": ({"prompt_logprobs": 0},
                        lambda r, b, t: r.json()["choices"][0].get("prompt_logprobs") is not None
                        or r.json().get("prompt_logprobs") is not None or pytest.fail()),
    "allowed_token_ids": (None, None),
    "bad_words": (None, None),
    "cache_salt": ({"cache_salt": "tenant"}, same_as_greedy),
    "truncate_prompt_tokens": ({"truncate_prompt_tokens": 3},
                               lambda r, b, t: r.json()["usage"]["prompt_tokens"] == 3 or pytest.fail()),
    "prediction": ({"prediction": {"type": "content", "content": "hello world"}}, predicted),
    # (SmolLM2 is no thinking model: no <think> tokens; a thinking model's budget:
    # tests/entrypoints/openai/test_reasoning.py)
    # vLLM's beam search: n beams (tests/e2e/test_beam_search.py: the offline search's beams)
    "use_beam_search": ({"use_beam_search": True, "n": 2},
                        lambda r, b, t: len(r.json()["choices"]) == 2 or pytest.fail(r.text)),
    "length_penalty": ({"length_penalty": 2.0}, refused("length_penalty")),  # (without use_beam_search)
    "early_stopping": ({"early_stopping": True}, refused("early_stopping")),  # (without use_beam_search)
    "thinking_token_budget": ({"thinking_token_budget": 4}, lambda r, b, t: (
        refused("thinking_token_budget")(r, b, t), "</think> tokens" in r.json()["error"]["message"] or pytest.fail())),
    # OpenAI's caching, safety and tier hints: accepted without effect (docs/serving.md).
    "prompt_cache_key": ({"prompt_cache_key": "k-1"}, same_as_greedy),
    "prompt_cache_retention": ({"prompt_cache_retention": "24h"}, same_as_greedy),
    "prompt_cache_options": ({"prompt_cache_options": {"mode": "implicit", "ttl": "30m"}}, same_as_greedy),
    "safety_identifier": ({"safety_identifier": "user-1"}, same_as_greedy),
    "service_tier": ({"service_tier": "auto"}, same_as_greedy),
}
CHAT_ONLY = {
    "messages": ({"messages": MESSAGES}, ok),
    "max_completion_tokens": ({"max_completion_tokens": 2, "ignore_eos": True},
                              lambda r, b, t: tokens(r) == 2 or pytest.fail()),
    "logprobs": ({"logprobs": True}, lambda r, b, t: r.json()["choices"][0]["logprobs"] or pytest.fail()),
    "top_logprobs": ({"logprobs": True, "top_logprobs": 3},
                     lambda r, b, t: len(r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 3
                     or pytest.fail()),
    "add_generation_prompt": ({"add_generation_prompt": False},
                              lambda r, b, t: r.json()["usage"]["prompt_tokens"] < b.json()["usage"]["prompt_tokens"]
                              or pytest.fail()),
    "continue_final_message": ({"messages": [*MESSAGES, {"role": "assistant", "content": "the"}],
                                "continue_final_message": True, "add_generation_prompt": False}, ok),
    "chat_template": ({"chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"},
                      lambda r, b, t: r.json()["usage"]["prompt_tokens"] == len(t.encode("hello world",
                                                                                         add_special_tokens=False))
                      or pytest.fail()),
    "chat_template_kwargs": ({"chat_template": "{{ greeting }}", "chat_template_kwargs": {"greeting": "hello"}},
                             lambda r, b, t: r.json()["usage"]["prompt_tokens"] == len(t.encode(
                                 "hello", add_special_tokens=False)) or pytest.fail()),
    # vLLM's: a RAG template's sources (the field was dropped and `documents` was None)
    "documents": ({"chat_template": "{% for d in documents %}{{ d.text }} {% endfor %}{{ messages[0].content }}",
                   "documents": [{"title": "a", "text": "the quick"}, {"title": "b", "text": "brown fox"}]},
                  lambda r, b, t: r.json()["usage"]["prompt_tokens"] == len(t.encode(
                      "the quick brown fox hello world", add_special_tokens=False)) or pytest.fail(r.text)),
    # vLLM's (with --reasoning-parser; tests/entrypoints/openai/test_reasoning.py): this
    # server has none, so the answer is the same
    "include_reasoning": ({"include_reasoning": False}, same_as_greedy),
    "tools": ({"tools": TOOLS, "tool_choice": "required", "max_tokens": 200},
              lambda r, b, t: r.json()["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "f"
              or pytest.fail()),
    "tool_choice": ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "f"}}, "max_tokens": 50},
                    lambda r, b, t: json.loads(r.json()["choices"][0]["message"]["tool_calls"][0]["function"][
                        "arguments"])["x"] in (1, 2) or pytest.fail()),
    "functions": ({"functions": [TOOLS[0]["function"]], "function_call": {"name": "f"}, "max_tokens": 50},
                  lambda r, b, t: r.json()["choices"][0]["message"]["function_call"]["name"] == "f"
                  or pytest.fail()),
    "function_call": ({"functions": [TOOLS[0]["function"]], "function_call": "none"},
                      lambda r, b, t: not r.json()["choices"][0]["message"].get("function_call") or pytest.fail()),
    "parallel_tool_calls": ({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False,
                             "max_tokens": 200},
                            lambda r, b, t: len(r.json()["choices"][0]["message"]["tool_calls"]) == 1 or pytest.fail()),
    # Accepted without effect (docs/serving.md says why), or refused where they ask for
    # what this server cannot do.
    "reasoning_effort": ({"reasoning_effort": "low"}, same_as_greedy),
    "verbosity": ({"verbosity": "high"}, same_as_greedy),
    "metadata": ({"metadata": {"ticket": "T-1"}}, same_as_greedy),
    "store": ({"store": True}, refused("store")),
    "modalities": ({"modalities": ["text", "audio"]}, refused("modalities")),
    "web_search_options": ({"web_search_options": {}}, refused("web_search_options")),
    # vLLM's chat echo: the final assistant turn before the answer (completions' is below).
    "echo": ({"echo": True, **CONTINUED}, lambda r, b, t: text(r) == "The answer" + text(post(
        SERVER[0], True, **CONTINUED)) or pytest.fail()),
}
COMPLETION_ONLY = {
    "prompt": ({"prompt": [5, 6, 7]}, ok),
    "echo": ({"echo": True}, lambda r, b, t: text(r) == PROMPT + text(b) or pytest.fail()),
    "logprobs": ({"logprobs": 2}, lambda r, b, t: len(r.json()["choices"][0]["logprobs"]["top_logprobs"][0]) >= 2
                 or pytest.fail()),
    "suffix": ({"suffix": "!"}, refused("suffix")),
}
# vLLM's best_of, on both routes: taken where it equals n (no candidates to pick among), else refused.
CHAT_ONLY["best_of"] = COMPLETION_ONLY["best_of"] = ({"best_of": 2, "n": 1}, refused("best_of"))
SERVER, CHAT = [None], [False]


@pytest.mark.parametrize("chat", [True, False])
def test_every_request_field_works_or_is_refused(server, tokenizer, chat):
    SERVER[0], CHAT[0] = server, chat
    model = ChatCompletionRequest if chat else CompletionRequest
    table = {**COMMON, **(CHAT_ONLY if chat else COMPLETION_ONLY)}
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    word = tokenizer.convert_tokens_to_ids("the")
    table["logit_bias"] = ({"logit_bias": {str(word): 100}, "max_tokens": 3, "ignore_eos": True},
                           lambda r, b, t: t.encode(text(r), add_special_tokens=False) == [word] * 3 or pytest.fail())
    table["allowed_token_ids"] = ({"allowed_token_ids": [word], "max_tokens": 3, "ignore_eos": True},
                                  lambda r, b, t: text(r) == "thethethe" or pytest.fail())
    table["stop_token_ids"] = ({"stop_token_ids": [word], "logit_bias": {str(word): 100}},
                               lambda r, b, t: r.json()["choices"][0]["finish_reason"] == "stop" or pytest.fail())
    table["include_stop_str_in_output"] = (
        {"stop": ["the"], "include_stop_str_in_output": True, "logit_bias": {str(word): 100}},
        lambda r, b, t: text(r) == "the" or pytest.fail())
    table["bad_words"] = ({"bad_words": ["the"], "logit_bias": {str(word): 100}, "max_tokens": 3, "ignore_eos": True},
                          lambda r, b, t: word not in t.encode(text(r), add_special_tokens=False) or pytest.fail())
    missing = set(model.model_fields) - set(table)
    assert not missing, f"request fields with no decision in this table: {sorted(missing)}"
    baseline = post(server, chat)
    assert baseline.status_code == 200 and eos
    failures = []
    for name in sorted(model.model_fields):
        fields, check = table[name]
        r = post(server, chat, **fields)
        try:
            check(r, baseline, tokenizer)
        except (AssertionError, pytest.fail.Exception, KeyError, IndexError, TypeError, ValueError) as e:
            failures.append(f"{name}: {type(e).__name__} {e} -> {r.status_code} {r.text[:300]}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("field", ["mm_processor_kwargs", "media_io_kwargs"])
def test_vllms_per_request_media_settings_are_refused_by_name(server, chat, field):
    """vLLM's fields, which no processor or image decoder here takes: refused by name (each
    was logged as unknown and ignored)."""
    r = post(server, chat, **{field: {"image": {"num_crops": 4}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


@pytest.mark.parametrize(("field", "value", "status"), [
    ("use_beam_search", True, 200), ("use_beam_search", False, 200), ("length_penalty", 2.0, 400),
    ("length_penalty", 1, 200), ("early_stopping", "never", 400), ("early_stopping", False, 200),
    ("logits_processors", ["my.module:Proc"], 400), ("logits_processors", [], 200),
    ("vllm_xargs", {"k": 1}, 400), ("return_tokens_as_token_ids", True, 400), ("return_token_ids", True, 400),
    ("spaces_between_special_tokens", False, 200), ("spaces_between_special_tokens", "no", 400),
])
def test_vllms_other_fields_are_refused_by_name_unless_they_ask_for_nothing(server, field, value, status):
    """vLLM defines these; they were logged as unknown and ignored (beam search answered
    greedily; it is served now, and length_penalty without it refused).  Each refusal
    says why (spaces_between_special_tokens' ended at its colon)."""
    r = post(server, True, **{field: value})
    assert r.status_code == status, r.text
    if status == 400:
        assert r.json()["error"]["param"] == field
        assert not r.json()["error"]["message"].rstrip().endswith(":"), r.text


def test_an_error_names_the_field_the_client_sent_in_its_text_too(server):
    r = post(server, True, max_completion_tokens=0)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens"
    assert r.json()["error"]["message"].startswith("max_completion_tokens "), r.text


def test_echo_with_logprobs_gives_the_prompt_k_alternatives_whatever_prompt_logprobs(server):
    r = post(server, False, echo=True, logprobs=3, prompt_logprobs=0, max_tokens=2)
    sizes = [len(t) if t is not None else None for t in r.json()["choices"][0]["logprobs"]["top_logprobs"]]
    assert sizes[0] is None and all(n is not None and n >= 3 for n in sizes[1:]), sizes


_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
_USER = {"role": "user", "content": "hello world"}


@pytest.mark.parametrize(("chat", "fields", "param"), [
    # the other route's fields (each was ignored: the answer ran to max_tokens' default, no logprobs, no tools)
    (False, {"max_completion_tokens": 2}, "max_completion_tokens"), (False, {"top_logprobs": 2}, "top_logprobs"),
    (False, {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"), (False, {"store": True}, "store"),
    (True, {"suffix": "x"}, "suffix"),
    # a response_format whose constraint was dropped: no type, or text with a schema; json_schema's own rules
    (True, {"response_format": {"json_schema": {"name": "s", "schema": _SCHEMA}}}, "response_format"),
    (True, {"response_format": {"type": "text", "json_schema": {"name": "s", "schema": _SCHEMA}}}, "response_format"),
    (True, {"response_format": {"type": "json_schema", "json_schema": {"name": "bad name!", "schema": _SCHEMA}}},
     "response_format"),
    (True, {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": _SCHEMA,
                                                                       "strict": "yes"}}}, "response_format"),
    # keys OpenAI defines for no such message or part (each was dropped from the prompt)
    (True, {"messages": [{**_USER, "foo": 1}]}, "messages[0]"),
    (True, {"messages": [{**_USER, "tool_calls": []}]}, "messages[0]"),
    (True, {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {}}]}]},
     "messages[0]"),
    (True, {"messages": [_USER, {"role": "assistant", "content": None, "audio": {"id": "a1"}}, _USER]}, "messages[1]"),
    (True, {"messages": [_USER, {"role": "assistant", "content": "yes", "refusal": "no"}, _USER]}, "messages[1]"),
    (True, {"messages": [_USER, {"role": "function", "content": "42"}]}, "messages[1]"),  # (rendered as call_None's)
    # another key on a tool was written into the prompt; stream_options' was ignored
    (True, {"tools": [{"type": "function", "function": {"name": "f", "foo": 1}}]}, "tools"),
    (True, {"stream": True, "stream_options": {"include_usage": True, "foo": True}}, "stream_options"),
    # a template that never reads documents (they were dropped); logit_bias keys int() took
    (True, {"documents": [{"title": "a", "text": "SECRET"}]}, "documents"),
    (True, {"logit_bias": {"1_7": 5}}, "logit_bias"), (False, {"logit_bias": {"\uff11\uff17": 5}}, "logit_bias"),
    (True, {"logit_bias": {"9" * 5000: 5}}, "logit_bias"),  # (Python's message on int's digit limit, no param)
])
def test_fields_of_another_route_or_shape_are_refused_by_name(server, chat, fields, param):
    mark = server.log_mark()
    r = post(server, chat, **fields)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    warned = [line for line in server.log_since(mark).splitlines() if "ignoring unknown request field" in line]
    assert not any(repr(name) in line for line in warned for name in fields if name not in ("messages", "stream"))


def test_nullable_fields_take_their_default_and_a_refusal_sent_back_is_what_the_turn_said(server):
    """OpenAI's n and echo may be null (a 400 said null was no integer); an assistant turn
    sent back with its refusal (content null) says it (it was rendered as an empty turn)."""
    assert post(server, True, n=None).status_code == 200 and post(server, False, n=None, echo=None).status_code == 200
    # an answer sent back as the openai SDK sends it (its unset fields null, annotations []), and vLLM's best_of = n
    replayed = {"role": "assistant", "content": "Hi.", "refusal": None, "annotations": [], "audio": None,
                "function_call": None, "tool_calls": None, "reasoning_content": None}
    assert post(server, True, messages=[_USER, replayed, _USER], best_of=1).status_code == 200
    said = [_USER, {"role": "assistant", "content": "I cannot help with that."}, _USER]
    refused = [_USER, {"role": "assistant", "content": None, "refusal": "I cannot help with that."}, _USER]
    assert [post(server, True, messages=m).json()["usage"]["prompt_tokens"] for m in (said, refused)] == \
        [post(server, True, messages=said).json()["usage"]["prompt_tokens"]] * 2

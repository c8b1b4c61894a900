"""The translation of Anthropic's Messages requests into chat requests, and of the chat
handler's stream back into Anthropic's events (no server: see
tests/entrypoints/openai/test_anthropic_client.py for the real client)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.entrypoints.anthropic.protocol import MessagesRequest, anthropic_error_body
from pagedserve.entrypoints.anthropic.serving_messages import EventWriter, to_chat_request
from pagedserve.entrypoints.openai.serving_engine import OpenAIError
from tests.hypothesis_budget import examples


def request(**fields) -> MessagesRequest:
    return MessagesRequest.model_validate({"model": "m", "max_tokens": 8, **fields})


def test_a_tool_conversation_becomes_chat_messages_and_tools() -> None:
    req = request(system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Use tools."}],
                  stop_sequences=["END"], temperature=0.5, top_k=4, metadata={"user_id": "u1"},
                  tools=[{"name": "f", "description": "d", "input_schema": {"type": "object"}}],
                  tool_choice={"type": "any", "disable_parallel_tool_use": True},
                  messages=[
                      {"role": "user", "content": "hi"},
                      {"role": "assistant", "content": [{"type": "text", "text": "calling"},
                                                        {"type": "tool_use", "id": "toolu_1", "name": "f",
                                                         "input": {"x": 1}}]},
                      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                    "content": [{"type": "text", "text": "boom"}], "is_error": True},
                                                   {"type": "text", "text": "and now?"}]}])
    chat = to_chat_request(req, stream=True)
    msgs = [m.model_dump(exclude_unset=True) for m in chat.messages]
    assert msgs == [
        {"role": "system", "content": "Be brief.\nUse tools."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "calling", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Error: boom"},
        {"role": "user", "content": "and now?"}]
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False
    assert chat.tools[0].function.parameters == {"type": "object"} and chat.tools[0].function.description == "d"
    assert (chat.stop, chat.temperature, chat.top_k, chat.user, chat.max_tokens) == (["END"], 0.5, 4, "u1", 8)
    assert chat.stream and chat.stream_options.include_usage and chat.stream_options.continuous_usage_stats
    named = to_chat_request(request(messages=[{"role": "user", "content": "x"}], tools=req.tools,
                                    tool_choice={"type": "tool", "name": "f"}))
    assert named.tool_choice == {"type": "function", "function": {"name": "f"}}
    fmt = to_chat_request(request(messages=[{"role": "user", "content": "x"}], output_config={
        "format": {"type": "json_schema", "schema": {"type": "object"}}, "effort": "max"},
        service_tier="standard_only", speed="fast", cache_control={"type": "ephemeral", "ttl": "1h"},
        inference_geo="us", workspace_id="wrkspc_1", metadata={"user_id": "u" * 256}))  # (hints without effect)
    # A final assistant turn may be empty (nothing prefilled, the generation prompt), as
    # Anthropic allows; one with text is continued (a prefill).
    empty = to_chat_request(request(messages=[{"role": "user", "content": "x"}, {"role": "assistant", "content": []}]))
    assert empty.messages[-1].role == "user" and not empty.continue_final_message
    prefill = to_chat_request(request(messages=[{"role": "user", "content": "x"}, {"role": "assistant", "content": "{"}]))
    assert prefill.messages[-1].role == "assistant" and prefill.continue_final_message
    assert not prefill.add_generation_prompt
    assert fmt.response_format == {"type": "json_schema", "json_schema": {"name": "output", "schema": {"type": "object"}}}


@pytest.mark.parametrize("fields, match", [
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "'document' blocks"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "needs a source of type base64"),
    # (a JPEG labelled PNG: Anthropic's 400; it was served)
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "/9j/4AAQSkZJRgABAQ"}}]}]},
     "does not match the provided media type image/png"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f"}]}]}, "'tool_use'"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}, "tool_use_id"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": 7}]}]},
     "a string or a list of text blocks"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "x"}]}]},
     "answers no earlier tool_use block"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "a text block's text must be a string"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": []},
                   {"role": "user", "content": "y"}]}, r"messages\[1\].content is an empty list"),
    ({"messages": [{"role": "user", "content": "x"}], "mcp_servers": [{"type": "url", "url": "http://x"}]},
     "mcp_servers is not supported"),
    ({"messages": [{"role": "user", "content": "x"}], "container": "c1"}, "container is not supported"),
    ({"messages": [{"role": "user", "content": "x"}], "context_management": {"edits": []}},
     "context_management is not supported"),
    ({"messages": [{"role": "user", "content": "x"}], "metadata": {"user_id": 5}}, "metadata takes user_id alone"),
    ({"messages": [{"role": "user", "content": "x"}], "metadata": {"foo": "bar"}}, "metadata takes user_id alone"),
    ({"messages": [{"role": "user", "content": "x"}], "metadata": {"user_id": "u" * 257}}, "at most 256"),
    ({"messages": [{"role": "user", "content": "x"}], "output_config": {"effort": "ultra"}},
     "output_config.effort must be"),
    ({"messages": [{"role": "user", "content": "x"}], "cache_control": {"type": "whatever"}}, "cache_control.type"),
    ({"messages": [{"role": "user", "content": "x"}], "inference_geo": "x" * 200}, "inference_geo is 200 characters"),
    ({"messages": [{"role": "user", "content": "x"}], "system": [{"type": "image"}]}, "only text blocks"),
    ({"messages": [{"role": "user", "content": "x"}], "thinking": {"type": "enabled", "budget_tokens": 10}},
     r"max_tokens must be greater than thinking.budget_tokens \(8 <= 10\)"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"name": "f", "input_schema": {"type": "object"}}],
      "tool_choice": {"type": "tool"}}, "needs the tool's name"),
    # Anthropic's rules on tools (a non-object schema's input was wrapped as {"value": ...};
    # server tools and beta fields were dropped, silently)
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"name": "f", "input_schema": {"type": "string"}}]},
     "of type \"object\""),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     "server tools"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"name": "f", "input_schema": {"type": "object"},
                                                                 "defer_loading": True}]}, r"tools\[0\].defer_loading"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"name": "bad name!", "input_schema": {"type": "object"}}]},
     "must match"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"name": "f", "input_schema": {"type": "object"}}] * 2},
     "unique"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"name": "f", "input_schema": {"type": "object"},
                                                                 "cache_control": {"type": "bogus"}}]}, "cache_control"),
    # Anthropic's rules on the conversation
    ({"messages": [{"role": "user", "content": ""}]}, "must be non-empty"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "The capital is "}]},
     "trailing whitespace"),
    ({"messages": [{"role": "user", "content": "x"},
                   {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
                   {"role": "user", "content": "what now?"}]}, "without tool_result blocks immediately after: t1"),
    ({"messages": [{"role": "user", "content": "x"},
                   {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]}]},
     "without tool_result"),
    ({"messages": [{"role": "user", "content": "x"}], "output_config": {"verbosity": "low"}},
     "output_config takes format, effort"),
    # (the prompt writes tool results first: text before one was moved after it, silently)
    ({"messages": [{"role": "user", "content": "x"},
                   {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
                   {"role": "user", "content": [{"type": "text", "text": "Here:"},
                                                {"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]}]},
     r"messages\[2\].content\[1\]: tool_result blocks must come before any other content"),
    ({"messages": [{"role": "user", "content": "x"}], "output_config": {"format": {"type": "regex"}}},
     "json_schema"),
])
def test_what_cannot_be_translated_is_refused_by_name(fields, match) -> None:
    with pytest.raises(OpenAIError, match=match):
        to_chat_request(request(**fields))


_TOOLS = [{"name": "f", "input_schema": {"type": "object"}}]
_CALL = {"type": "tool_use", "id": "t1", "name": "f", "input": {}}


@pytest.mark.parametrize("fields, match", [
    # Anthropic's rules a request was let through on (each was a 200)
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": ""}]}]}, "must be non-empty"),
    ({"messages": [{"role": "user", "content": "   "}]}, "must contain non-whitespace text"),
    ({"messages": [{"role": "user", "content": "x"}], "system": [{"type": "text", "text": " "}]}, "non-whitespace"),
    ({"messages": [{"role": "user", "content": "x"}], "stop_sequences": [" "]}, "must contain non-whitespace"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": [_CALL, _CALL]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "r"}]}],
      "tools": _TOOLS}, "tool_use ids must be unique"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": [_CALL]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "r"}]}]},
     "must define tools"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": [_CALL]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "r",
                                                 "is_error": "yes"}]}], "tools": _TOOLS}, "is_error must be true"),
    ({"messages": [{"role": "user", "content": "x"},
                   {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f"}]}], "tools": _TOOLS},
     "an object input"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": _TOOLS, "tool_choice": {"type": "auto", "name": "f"}},
     "takes no name"),
    ({"messages": [{"role": "user", "content": "x"}], "thinking": {}}, "thinking.type must be"),
    ({"messages": [{"role": "user", "content": "x"}], "thinking": {"type": "disabled", "budget_tokens": 9}},
     "'disabled' takes type, got budget_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "thinking": {"type": "enabled"}},
     "budget_tokens must be an integer >= 1, got None"),
    ({"messages": [{"role": "user", "content": "x"}], "thinking": {"type": "enabled", "budget_tokens": 0}},
     "budget_tokens must be an integer >= 1"),
    ({"messages": [{"role": "user", "content": "x"}], "thinking": {"type": "adaptive", "budget_tokens": 4}},
     "'adaptive' takes display, type, got budget_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "thinking": {"type": "adaptive", "display": "full"}},
     "thinking.display must be"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "cache_control": {"type": "bogus"}}]}]},
     r"messages\[0\].content\[0\].cache_control.type must be ephemeral"),
    ({"messages": [{"role": "user", "content": "x"}],
      "system": [{"type": "text", "text": "s", "cache_control": {"type": "ephemeral", "ttl": "9h"}}]}, "ttl must be"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "cache_control": "yes"}]}]},
     "must be an object"),
    # a tool_result naming no call says so (it was reported as the previous call left unanswered)
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": [_CALL]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t9", "content": "r"}]}],
      "tools": _TOOLS}, "'t9' answers no earlier tool_use"),
    ({"messages": [{"role": "assistant", "content": [{"type": "thinking", "signature": "s"}]}]}, "needs its thinking"),
    # a key Anthropic defines for no such block (it was dropped), one asking for what is not here
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "bogus": 1}]}]},
     r"messages\[0\].content\[0\]: 'bogus' is not a field of a text block"),
    ({"messages": [{"role": "user", "content": "x"}], "system": [{"type": "text", "text": "s", "bogus": 1}]}, "'bogus'"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": [{**_CALL, "caller": {
        "type": "code_execution_20250825"}}]}, {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": "r"}]}], "tools": _TOOLS}, "caller"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "citations": "yes"}]}]},
     "citations must be a list"),
    # (an unhashable type was a 500: the schema fuzz's)
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": [{"type": [], "text": "a"}]}]},
     "blocks are not supported"),
])
def test_anthropics_rules_on_blocks_and_configs_are_refused_by_name(fields, match) -> None:
    with pytest.raises(OpenAIError, match=match):
        to_chat_request(request(**fields))


def test_an_answer_sent_back_with_anthropics_own_keys_is_read_as_without_them() -> None:
    """A past answer's blocks as Anthropic's API returns them (citations, a direct caller)."""
    def turns(**keys):
        return [{"role": "user", "content": "x"},
                {"role": "assistant", "content": [{"type": "text", "text": "a", **keys.get("text", {})},
                                                  {**_CALL, **keys.get("call", {})}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "r"}]}]
    with_keys = request(messages=turns(text={"citations": None}, call={"caller": {"type": "direct"}}), tools=_TOOLS)
    assert to_chat_request(with_keys) == to_chat_request(request(messages=turns(), tools=_TOOLS))


@pytest.mark.parametrize("fields", [{"max_tokens": 0}, {"top_k": -1}, {"tool_choice": {"type": "auto", "foo": 1}}])
def test_fields_out_of_anthropics_bounds_do_not_parse(fields) -> None:
    with pytest.raises(ValueError):
        request(messages=[{"role": "user", "content": "x"}], **fields)


def test_a_blank_system_block_is_named_as_the_system() -> None:
    with pytest.raises(OpenAIError, match="non-whitespace") as e:
        to_chat_request(request(messages=[{"role": "user", "content": "x"}], system=[{"type": "text", "text": " "}]))
    assert e.value.param == "system"  # (it was "messages")


def test_thinking_sent_back_is_left_out_and_disabled_thinking_is_off() -> None:
    """An earlier answer's thinking blocks, as clients send them back, are accepted and left
    out of the prompt (they were a 400); thinking disabled turns a hybrid model's thinking
    off and its blocks out of the answer; consecutive turns of one role are one turn."""
    chat = to_chat_request(request(thinking={"type": "disabled"}, messages=[
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": ""},
                                          {"type": "redacted_thinking", "data": "abc"},
                                          {"type": "text", "text": "Hello."}]},
        {"role": "user", "content": "Paris?"}, {"role": "user", "content": [{"type": "text", "text": "Or Rome?"}]}]))
    assert [m.model_dump(exclude_unset=True) for m in chat.messages] == [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Paris?\nOr Rome?"}]
    assert chat.chat_template_kwargs == {"enable_thinking": False}
    assert to_chat_request(request(messages=[{"role": "user", "content": "x"}])).chat_template_kwargs is None
    usage = {"prompt_tokens": 3, "completion_tokens": 1}
    for blocks, started, deltas in (("none", ["text"], ["text_delta"]),
                                    ("omitted", ["thinking", "text"], ["text_delta"]),  # (its text left out)
                                    ("shown", ["thinking", "text"], ["thinking_delta", "text_delta"])):
        w = EventWriter("msg_1", "m", 3, thinking=blocks)
        events = _events([f for c in [{"choices": [{"index": 0, "delta": {"reasoning_content": "hmm"}}],
                                       "usage": usage},
                                      {"choices": [{"index": 0, "delta": {"content": "Hi"}}], "usage": usage}]
                          for f in w.on_chunk(c)])
        assert [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"] == started
        assert [e["delta"]["type"] for e in events if e["type"] == "content_block_delta"] == deltas


def test_thinking_enabled_is_the_template_switch_and_a_token_budget() -> None:
    chat = to_chat_request(request(max_tokens=64, thinking={"type": "enabled", "budget_tokens": 16},
                                   messages=[{"role": "user", "content": "x"}]))
    assert (chat.chat_template_kwargs, chat.thinking_token_budget) == ({"enable_thinking": True}, 16)
    chat = to_chat_request(request(thinking={"type": "adaptive"}, messages=[{"role": "user", "content": "x"}]))
    assert (chat.chat_template_kwargs, chat.thinking_token_budget) == ({"enable_thinking": True}, None)


def test_an_empty_system_prompt_is_none() -> None:
    """`system: ""` or `[]` is no system prompt (the template's default stays), as Anthropic reads it."""
    for system in ("", []):
        chat = to_chat_request(request(system=system, messages=[{"role": "user", "content": "x"}]))
        assert [m.role for m in chat.messages] == ["user"]


def _events(frames: list[str]) -> list[dict]:
    return [json.loads(f.split("data: ", 1)[1]) for f in frames]


def test_chunks_become_blocks_opened_and_closed_around_their_deltas() -> None:
    w = EventWriter("msg_1", "m", 7)
    usage = {"prompt_tokens": 7, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 4}}
    chunks = [
        # the role's chunk: the prompt's usage before any token, cached tokens unknown yet: held
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}],
         "usage": {"prompt_tokens": 7, "completion_tokens": 0, "total_tokens": 7}},
        {"choices": [{"index": 0, "delta": {"reasoning_content": "hmm"}}], "usage": usage},
        {"choices": [{"index": 0, "delta": {"content": "Let me "}}], "usage": usage},
        {"choices": [{"index": 0, "delta": {"content": "check."}}], "usage": usage},
        {"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "id": "call_abc", "type": "function", "function": {"name": "f", "arguments": '{"x"'}}]}}],
         "usage": usage},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}}],
         "usage": usage},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}], "usage": usage},
        {"choices": [], "usage": {**usage, "completion_tokens": 9}},
    ]
    events = _events([f for c in chunks for f in w.on_chunk(c)])
    assert events[1] == {"type": "ping"}  # (after message_start, as Anthropic's streams)
    thinking, events = events[2:5], [events[0], *events[5:]]
    assert [e["type"] for e in thinking] == ["content_block_start", "content_block_delta", "content_block_stop"]
    assert thinking[0]["content_block"]["type"] == "thinking" and thinking[1]["delta"] == {
        "type": "thinking_delta", "thinking": "hmm"}
    assert [e["type"] for e in events] == [
        "message_start", "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop"]
    assert events[0]["message"]["usage"] == {"input_tokens": 3, "output_tokens": 0, "cache_read_input_tokens": 4,
                                             "cache_creation_input_tokens": 0}
    assert events[5]["content_block"] == {"type": "tool_use", "id": "toolu_abc", "name": "f", "input": {}}
    assert "".join(e["delta"]["partial_json"] for e in events[6:8]) == '{"x": 1}'
    assert [e["index"] for e in events[1:9]] == [1, 1, 1, 1, 2, 2, 2, 2]
    assert events[9]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert events[9]["usage"] == {"input_tokens": 3, "output_tokens": 9, "cache_read_input_tokens": 4,
                                  "cache_creation_input_tokens": 0}  # (streamed too: the client read None)


def test_a_stream_error_is_an_error_event_in_anthropics_shape() -> None:
    w = EventWriter("msg_1", "m", 3)
    events = _events(w.on_chunk({"error": {"message": "busy", "type": "server_error", "code": "server_overloaded"}}))
    assert [e["type"] for e in events] == ["message_start", "ping", "error"]
    assert events[2]["error"] == {"type": "overloaded_error", "message": "busy"}
    assert anthropic_error_body(404, "x") == {"type": "error", "error": {"type": "not_found_error", "message": "x"}}
    assert anthropic_error_body(500, "x")["error"]["type"] == "api_error"


def test_a_chat_error_names_anthropics_field() -> None:
    """The chat path's refusal of `stop` says stop_sequences, in its text too (Anthropic's error body has no param)."""
    from pagedserve.entrypoints.anthropic.serving_messages import AnthropicServingMessages

    e = AnthropicServingMessages._renamed(OpenAIError("stop must be a non-empty string", param="stop"))
    assert (e.param, e.message) == ("stop_sequences", "stop_sequences must be a non-empty string")


def _merged_by_turns(messages: list[dict]) -> list[dict]:
    """The merge as it was written first (each turn joined onto the last, quadratic):
    the reference for what the merged turns must be."""
    out: list[dict] = []
    for message in messages:
        prev = out[-1] if out else None
        if prev is not None and prev["role"] == message["role"] in ("user", "assistant") \
                and not prev.get("tool_calls") and isinstance(prev["content"], str) \
                and isinstance(message["content"], (str, type(None))):
            out[-1] = {**message, "content": "\n".join(t for t in (prev["content"], message["content"]) if t)}
            continue
        out.append(message)
    return out


_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "tool", "system"]),
     "content": st.one_of(st.none(), st.sampled_from(["", "a", "b c"]), st.just([{"type": "image"}]))},
    optional={"tool_calls": st.just([{"id": "1"}])})


@given(st.lists(_MESSAGE, max_size=10))
@settings(max_examples=examples(300), deadline=None)
def test_the_linear_merge_merges_as_turn_by_turn_joining_did(messages) -> None:
    from pagedserve.entrypoints.anthropic.serving_messages import _merged

    before = repr(messages)
    assert _merged(messages) == _merged_by_turns(messages)
    assert repr(messages) == before  # (the caller's turns are not changed)


def test_many_turns_of_one_role_merge_in_linear_time() -> None:
    """52,000 one-line user turns (a 16 MB body): joined a turn at a time they took 81 s of
    a core before the prompt's size was judged (Zen 4, AVX-512, native bf16); now ~0.5 s."""
    import time

    req = request(messages=[{"role": "user", "content": "x" * 280} for _ in range(52_000)])
    start = time.monotonic()
    [message] = to_chat_request(req).messages
    assert len(message.content) == 52_000 * 281 - 1 and time.monotonic() - start < 10


@pytest.mark.parametrize("source", [{"type": []}, {"type": {"a": 1}}, {"type": "url", "url": "u", "z": 1}, None])
def test_a_malformed_image_source_is_a_named_400(source) -> None:
    """A source's type of any JSON shape (a list was looked up among the source types: a
    TypeError, a 500); a key a source type does not define is refused by name."""
    with pytest.raises(OpenAIError, match=r"messages\[0\]\.content\[0\]: ") as e:
        to_chat_request(request(messages=[{"role": "user", "content": [{"type": "image", "source": source}]}]))
    assert e.value.param == "messages"


def test_cache_salt_is_taken_as_chat_takes_it() -> None:
    """vLLM's cache_salt was logged as unknown here, and the salted prompt shared another
    tenant's cached blocks (cache_read_input_tokens said so)."""
    assert to_chat_request(request(messages=[{"role": "user", "content": "x"}], cache_salt="tenant")).cache_salt == \
        "tenant"
    assert to_chat_request(request(messages=[{"role": "user", "content": "x"}])).cache_salt is None
    with pytest.raises(ValueError, match="cache_salt"):
        request(messages=[{"role": "user", "content": "x"}], cache_salt=5)

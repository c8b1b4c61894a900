"""--reasoning-parser: the split of <think>...</think> into reasoning_content, on the
parser alone (every prefix of a streamed answer) and through the chat API (a scripted
engine, streamed and not, with a tool call after the reasoning)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.entrypoints.openai.api_server import Attachment, ServerState, build_app
from pagedserve.entrypoints.openai.reasoning_parsers import REASONING_PARSERS, get_reasoning_parser
from pagedserve.entrypoints.openai.tool_parsers import get_tool_parser
from tests.engine.fake_engine import FakeEngine
from tests.entrypoints.openai.test_api_fake_engine import call, events

QWEN3, R1 = REASONING_PARSERS["qwen3"], REASONING_PARSERS["deepseek_r1"]


@pytest.mark.parametrize("parser, text, want", [
    (QWEN3, "<think>\nhmm\n</think>\n\nParis", ("\nhmm\n", "Paris")),
    (QWEN3, "Paris", ("", "Paris")),  # enable_thinking false: the template closed an empty block
    (QWEN3, "<think>still thinking", ("still thinking", "")),  # out of tokens mid-thought
    (QWEN3, "hmm</think>Paris", ("", "hmm</think>Paris")),  # not opened by the model: content
    (R1, "hmm\n</think>\n\nParis", ("hmm\n", "Paris")),
    (R1, "<think>hmm</think>Paris", ("hmm", "Paris")),
    (R1, "still thinking", ("still thinking", "")),
])
def test_finished_answers_split(parser, text, want) -> None:
    assert parser.split(text, finished=True) == want


_PIECE = st.text(st.sampled_from("ab <>/\nthink"), max_size=12).filter(lambda s: "<think>" not in s
                                                                         and "</think>" not in s)


@given(parser=st.sampled_from([QWEN3, R1]), reasoning=_PIECE, content=_PIECE, opened=st.booleans(),
       closed=st.booleans())
def test_every_streamed_prefix_is_a_prefix_of_the_final_split(parser, reasoning, content, opened, closed) -> None:
    """Both parts only grow as characters arrive, and no tag ever shows in either."""
    text = ("<think>" if opened else "") + reasoning + ("</think>" + content if closed else "")
    final = parser.split(text, finished=True)
    for cut in range(len(text) + 1):
        r, c = parser.split(text[:cut], finished=False)
        assert final[0].startswith(r) and final[1].startswith(c), (text[:cut], r, c, final)
    if opened or parser is R1:  # a block was parsed: neither part shows a tag
        assert "</think>" not in final[0] + final[1] and not final[1].startswith("<think>")
    else:
        assert final == ("", text)


def test_unknown_parser_is_refused() -> None:
    assert get_reasoning_parser(None) is None
    with pytest.raises(ValueError, match="unknown reasoning parser 'o1'"):
        get_reasoning_parser("o1")


def _app(script: str, tool_parser: str | None = None):
    state = ServerState(served_model_names=["fake"])
    app = build_app(state)
    engine = FakeEngine(script=script)
    engine.max_model_len = 2048  # (the tools' system block is long in characters, its tokens here)
    state.attach(Attachment.local(AsyncLLM(engine, log_stats=False), 2048),
                 get_tool_parser(tool_parser) if tool_parser else None, QWEN3)
    return app


def test_chat_returns_reasoning_apart_streamed_or_not() -> None:
    script = "<think>\nLet me see.\n</think>\n\nParis."
    app = _app(script)
    body = {"model": "fake", "messages": [{"role": "user", "content": "capital?"}], "max_tokens": len(script)}

    async def both(client):
        full = (await client.post("/v1/chat/completions", json=body)).json()
        streamed = (await client.post("/v1/chat/completions", json={**body, "stream": True})).text
        return full, streamed

    full, streamed = call(app, both)
    message = full["choices"][0]["message"]
    assert message["reasoning_content"] == "\nLet me see.\n" and message["content"] == "Paris."
    deltas = [e["choices"][0]["delta"] for e in events(streamed)[:-1] if e["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == message["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == "Paris."
    assert not any("think>" in (d.get("content") or "") + (d.get("reasoning_content") or "") for d in deltas)


def test_a_tool_call_after_the_reasoning_is_read_from_the_content() -> None:
    call_text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    script = "<think>The user wants weather.</think>\n" + call_text
    app = _app(script, tool_parser="hermes")
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}
    body = {"model": "fake", "messages": [{"role": "user", "content": "weather?"}], "tools": [tool],
            "max_tokens": len(script)}

    async def both(client):
        full = (await client.post("/v1/chat/completions", json=body)).json()
        streamed = (await client.post("/v1/chat/completions", json={**body, "stream": True})).text
        return full, streamed

    full, streamed = call(app, both)
    assert "choices" in full, full
    choice = full["choices"][0]
    assert choice["finish_reason"] == "length", choice  # (the fake ends at max_tokens, not with an EOS)
    assert choice["message"]["reasoning_content"] == "The user wants weather."
    (tc,) = choice["message"]["tool_calls"]
    assert tc["function"]["name"] == "get_weather" and json.loads(tc["function"]["arguments"]) == {"city": "Paris"}
    deltas = [e["choices"][0]["delta"] for e in events(streamed)[:-1] if e["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "The user wants weather."
    calls = [c for d in deltas for c in d.get("tool_calls") or []]
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert not "".join(d.get("content") or "" for d in deltas).strip()

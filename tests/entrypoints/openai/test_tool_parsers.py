"""A tool-enabled answer streamed piece by piece says what it says whole: the content
chunks join to the whole answer's content, and the same calls come out."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.entrypoints.openai.serving_chat import OpenAIServingChat, ToolPlan, ToolStream
from pagedserve.entrypoints.openai.tool_parsers import (
    HermesToolParser,
    Llama3JsonToolParser,
    arguments_object,
)
from pagedserve.outputs import CompletionOutput

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
PIECES = ["Let me check.", "Sure", " ", "  ", "\n", "\n\n", "\t", "<tool", "_call>", CALL, "ok "]


def _streamed(plan: ToolPlan, text: str, cuts: list[int]) -> tuple[str, list[str]]:
    """(content, call names) as a stream sends them when the answer arrives cut at `cuts`."""
    ts, content, names = ToolStream(), "", []
    ends = sorted({c for c in cuts if 0 < c < len(text)}) + [len(text)]
    for end in ends:
        out = CompletionOutput(0, text[:end], [], finish_reason="stop" if end == len(text) else None)
        for choice in OpenAIServingChat._tool_deltas(None, plan, ts, out):  # k None: self unused
            content += choice.delta.content or ""
            names += [tc.function.name for tc in choice.delta.tool_calls or []]
    return content, names


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(PIECES), max_size=8), st.lists(st.integers(0, 400), max_size=12))
def test_hermes_streamed_content_and_calls_equal_the_whole_answer(pieces: list[str], cuts: list[int]) -> None:
    text = "".join(pieces)
    plan = ToolPlan(mode="auto", parser=HermesToolParser())
    whole, calls = plan.calls(text, True)
    content, names = _streamed(plan, text, cuts)
    assert content == (whole or ""), (text, cuts)
    assert names == [c.name for c in calls]


def test_whitespace_before_a_call_is_not_content_whole_or_streamed() -> None:
    plan = ToolPlan(mode="auto", parser=HermesToolParser())
    text = "I'll look that up.\n\n" + CALL
    assert plan.calls(text, True)[0] == "I'll look that up."
    assert _streamed(plan, text, list(range(len(text))))[0] == "I'll look that up."
    assert plan.calls("\n" + CALL, True)[0] is None
    assert _streamed(plan, "\n" + CALL, [1])[0] == ""
    # No call after all: the held-back whitespace is the answer's, sent at the end.
    assert _streamed(plan, "Fine.\n\n", [5, 6])[0] == "Fine.\n\n"


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(["", " ", "\n", "<|python_tag|>"]), st.booleans(), st.lists(st.integers(0, 120), max_size=8))
def test_llama3_json_streamed_equals_whole(head: str, is_call: bool, cuts: list[int]) -> None:
    body = json.dumps({"name": "f", "parameters": {"x": 1}}) if is_call else "Plain {text} answer."
    text = head + body
    plan = ToolPlan(mode="auto", parser=Llama3JsonToolParser())
    whole, calls = plan.calls(text, True)
    content, names = _streamed(plan, text, cuts)
    assert content == (whole or "") and names == [c.name for c in calls]


@pytest.mark.parametrize(("arguments", "want"), [
    ('{"city": "Paris", "unit": "c"}', {"city": "Paris", "unit": "c"}),
    ('{"city": "Paris", "unit":', {"city": "Paris"}),
    ('{"city": "Par', {}),
    ('{"a": {"b": 1, "c": [1, 2', {"a": {"b": 1}}),
    ('{"n": 12, ', {"n": 12}),
    ("", {}),
    ("[1, 2]", {}),
])
def test_a_tool_call_cut_short_keeps_its_complete_members(arguments, want) -> None:
    """A call max_tokens cut is the members it completed (Anthropic's tool_use input, whole
    as its client reads the streamed partial_json; Ollama's arguments): whole was {}."""
    assert arguments_object(arguments) == want

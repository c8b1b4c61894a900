"""A tool-enabled answer streamed piece by piece says what it says whole: the content
chunks join to the whole answer's content, and the same calls come out."""

from __future__ import annotations

import json

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pagedserve.entrypoints.openai.protocol import FunctionDefinition
from pagedserve.entrypoints.openai.serving_chat import OpenAIServingChat, ToolPlan, ToolStream
from pagedserve.entrypoints.openai.tool_parsers import (
    HermesToolParser,
    Llama3JsonToolParser,
    arguments_object,
)
from pagedserve.outputs import CompletionOutput

# The request's tools: a call of any other function is no call (NAMES: those below use).
NAMES = frozenset({"get_weather", "get_time", "f", "g", "h", "sql", "t"})
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
# (with a call left open, as a stop string or max_tokens leaves one: a finished answer's
# last one counts, as vLLM's; and one whose arguments are no object: not a call)
OPEN_CALL = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}'
# (an argument may hold the format's own tags: the structural tag lets a string say anything)
TAGS_CALL = '<tool_call>\n{"name": "g", "arguments": {"s": "wrap it in </tool_call> or <tool_call>"}}\n</tool_call>'
# (a tag in a code sample is text; a call cut inside its name or its arguments)
CODE_TAG = "```\n<tool_call>\n```"
CUT_NAME, CUT_ARGS = '<tool_call>\n{"name": "get_', '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lon'
PIECES = ["Let me check.", "Sure", " ", "  ", "\n", "\n\n", "\t", "<tool", "_call>", CALL, "ok ", OPEN_CALL,
          '<tool_call>{"name": "f", "arguments": [1]}</tool_call>', TAGS_CALL, "Done!", CODE_TAG, CUT_NAME, CUT_ARGS]


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
    plan = ToolPlan(mode="auto", parser=HermesToolParser(), names=NAMES)
    whole, calls = plan.calls(text, True)
    content, names = _streamed(plan, text, cuts)
    assert content == (whole or ""), (text, cuts)
    assert names == [c.name for c in calls]


@pytest.mark.parametrize("mode", ["auto", "required", "named"])
def test_a_finished_choice_of_several_says_its_finish_once(mode: str) -> None:
    """With n > 1 a finished choice stays in each output while the others go on: its
    finish_reason chunk was sent again at every step."""
    plan = ToolPlan(mode=mode, parser=HermesToolParser() if mode == "auto" else None, names=NAMES,
                    function=FunctionDefinition(name="get_weather") if mode == "named" else None)
    text = CALL if mode == "auto" else '[{"name": "get_weather", "parameters": {}}]' if mode == "required" else "{}"
    ts, out = ToolStream(), CompletionOutput(0, text, [], finish_reason="stop")
    finishes = [ch.finish_reason for _ in range(3) for ch in OpenAIServingChat._tool_deltas(None, plan, ts, out)
                if ch.finish_reason is not None]
    assert len(finishes) == 1


def test_an_argument_holding_the_tags_is_one_call_whole_or_streamed() -> None:
    """The lazy regex ended the call at the "</tool_call>" inside its string: the JSON did
    not parse and the whole call came back as content."""
    plan = ToolPlan(mode="auto", parser=HermesToolParser(), names=NAMES)
    text = "On it. " + TAGS_CALL + "\n" + CALL
    content, calls = plan.calls(text, True)
    assert content == "On it." and [c.name for c in calls] == ["g", "get_weather"]
    assert json.loads(calls[0].arguments) == {"s": "wrap it in </tool_call> or <tool_call>"}
    assert _streamed(plan, text, list(range(len(text)))) == ("On it.", ["g", "get_weather"])


@pytest.mark.parametrize(("text", "content", "calls"), [
    # text between and after the calls is content too (it was dropped: only the text before the first counted)
    ("A" + CALL + " middle " + CALL + "\nDone!", "A\nmiddle\nDone!", [("get_weather", '{"city": "Paris"}')] * 2),
    # a call cut by max_tokens or a stop string: a call with what it wrote (its markup was the content)
    ("Sure. " + CUT_ARGS, "Sure.", [("get_weather", '{"city": "Lon')]),
    (CALL + "\n" + CUT_ARGS[:-4] + '"London", "unit": "c"', None,
     [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "London", "unit": "c"')]),
    ("Sure. " + CUT_NAME, "Sure.", []),  # (cut inside its name: no call to make, and no markup)
    ('<tool_call>\n{"name": "get_weather"', None, [("get_weather", "")]),
    # a tag in a code sample is text: it hid the call after it (read past that call's closing tag)
    ("Use " + CODE_TAG + "\nthen " + CALL, "Use " + CODE_TAG + "\nthen", [("get_weather", '{"city": "Paris"}')]),
])
def test_text_around_calls_and_a_cut_call_whole_or_streamed(text: str, content: str | None, calls: list) -> None:
    plan = ToolPlan(mode="auto", parser=HermesToolParser(), names=NAMES)
    got, parsed = plan.calls(text, True)
    assert (got, [(c.name, c.arguments) for c in parsed]) == (content, calls)
    assert _streamed(plan, text, list(range(len(text)))) == (content or "", [name for name, _ in calls])
    if parsed:  # (what Anthropic's tool_use input and Ollama's arguments read of a cut call)
        assert arguments_object(parsed[-1].arguments) in ({"city": "Paris"}, {}, {"city": "London", "unit": "c"})


@pytest.mark.parametrize("mode", ["auto", "required"])
def test_a_stream_reads_each_call_once(mode, monkeypatch) -> None:
    """Each delta parsed the whole answer again (every call's JSON decoded at every delta:
    40 KB of calls held the event loop for 17 s, and openings left unclosed made the regex
    quadratic in each parse).  Now a stream's parse resumes after the calls it has read."""
    n = 60
    if mode == "auto":
        plan = ToolPlan(mode="auto", parser=HermesToolParser(), names=NAMES)
        text = "\n".join([CALL] * n)
    else:
        plan = ToolPlan(mode="required")
        text = "[" + ", ".join(['{"name": "f", "parameters": {"x": 1}}'] * n) + "]"
    decodes: list[int] = []  # each decode's distance from its start to the end of the text
    raw_decode = json.JSONDecoder.raw_decode

    def counted(self, s, idx=0):
        decodes.append(len(s) - idx)
        return raw_decode(self, s, idx)

    monkeypatch.setattr(json.JSONDecoder, "raw_decode", counted)
    _, names = _streamed(plan, text, list(range(0, len(text), 3)))  # (~1,700 deltas)
    assert len(names) == n
    if mode == "auto":  # each call decoded once, when its closing tag is in
        assert len(decodes) <= 3 * n, len(decodes)
    else:  # each delta decodes at most the item being written; the finished array is read once whole
        assert sum(d > 2 * len(CALL) for d in decodes) <= 1, decodes


def test_whitespace_before_a_call_is_not_content_whole_or_streamed() -> None:
    plan = ToolPlan(mode="auto", parser=HermesToolParser(), names=NAMES)
    text = "I'll look that up.\n\n" + CALL
    assert plan.calls(text, True)[0] == "I'll look that up."
    assert _streamed(plan, text, list(range(len(text))))[0] == "I'll look that up."
    assert plan.calls("\n" + CALL, True)[0] is None
    assert _streamed(plan, "\n" + CALL, [1])[0] == ""
    # No call after all: the held-back whitespace is the answer's, sent at the end.
    assert _streamed(plan, "Fine.\n\n", [5, 6])[0] == "Fine.\n\n"


LLAMA_PIECES = [json.dumps({"name": "f", "parameters": {"x": 1}}), json.dumps({"name": "g", "parameters": {"q": "a; b"}}),
                "; ", ";", " ;\n", "\n", " is what I would call", "Plain {text} answer.", "{", ""]


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["", " ", "\n", "<|python_tag|>"]), st.lists(st.sampled_from(LLAMA_PIECES), max_size=5),
       st.lists(st.integers(0, 200), max_size=8))
@example("", [LLAMA_PIECES[0], "; ", LLAMA_PIECES[1]], [len(LLAMA_PIECES[0]), len(LLAMA_PIECES[0]) + 2])
@example("", [LLAMA_PIECES[0], " is what I would call"], [len(LLAMA_PIECES[0])])
def test_llama3_json_streamed_equals_whole(head: str, pieces: list[str], cuts: list[int]) -> None:
    """Calls joined by ";" (one inside an argument's string is not a separator), text after
    them, cut anywhere: the stream sends what the whole answer says, each call once (a
    prefix that parsed as calls sent them, and again after a ";")."""
    text = head + "".join(pieces)
    plan = ToolPlan(mode="auto", parser=Llama3JsonToolParser(), names=NAMES)
    whole, calls = plan.calls(text, True)
    content, names = _streamed(plan, text, cuts)
    assert content == (whole or "") and names == [c.name for c in calls], (text, cuts)


def test_llama3_json_reads_calls_object_by_object() -> None:
    parser = Llama3JsonToolParser()
    text = '{"name": "sql", "parameters": {"q": "SELECT 1; SELECT 2"}} ; {"name": "t", "parameters": {"z": "東京"}};'
    content, calls = parser.extract(text)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("sql", {"q": "SELECT 1; SELECT 2"}), ("t", {"z": "東京"})]
    assert "東京" in calls[1].arguments  # (as written: not \\u escapes)
    for not_calls in ('{"name": "f", "parameters": "hello"}', '{"name": "f", "parameters": [1]}',
                      '{"name": "f", "parameters": {}} and some text'):
        assert parser.extract(not_calls) == (not_calls, [])
    assert parser.extract('{"name": "f", "parameters": "{\\"x\\": 1}"}')[1][0].arguments == '{"x": 1}'


def test_hermes_reads_a_finished_answers_last_call_left_open() -> None:
    parser = HermesToolParser()
    assert parser.extract("Sure. " + OPEN_CALL) == ("Sure.", [parser.extract(OPEN_CALL + "</tool_call>")[1][0]])
    assert parser.extract("Sure. " + OPEN_CALL, finished=False) == ("Sure. " + OPEN_CALL, [])


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


def test_pythonic_reads_a_list_of_calls_and_never_runs_it() -> None:
    from pagedserve.entrypoints.openai.tool_parsers import PythonicToolParser

    parser = PythonicToolParser()
    text = '[get_weather(city="東京", days=3, metric=true, extra=None), get_time(), f(x=[1, {"a": -2.5}])]'
    content, calls = parser.extract(text)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "東京", "days": 3, "metric": True, "extra": None}), ("get_time", {}),
        ("f", {"x": [1, {"a": -2.5}]})]
    assert parser.extract("<|python_start|>[f(a=1)]<|python_end|>")[1][0].arguments == '{"a": 1}'
    assert parser.format_calls(calls[:2]) == "[get_weather(city='東京', days=3, metric=True, extra=None), get_time()]"
    for not_calls in ("[f(1)]", "[__import__('os').system('true')]", "[f(x=open('/etc/passwd'))]",
                      "[f(x=1+1)]", "[f(**{'a': 1})]", "[]", "[f(x=(1, 2))]", "Sure: [f(x=1)]", "[f(x=1)] and more",
                      "[" * 500 + "]" * 500, "[f(x=" + "9" * 5000 + ")]", "[f(x=1e999)]", "[f(x=1, x=2)]"):
        assert parser.extract(not_calls) == (not_calls, []), not_calls
    assert parser.extract("[f(a=1)]", finished=False) == ("[f(a=1)]", [])
    assert parser.format_calls(parser.extract('[f(x=1)]')[1] + [type(calls[0])("g", '{"my-key": 1}')]) == \
        "[f(x=1), g(**{'my-key': 1})]"
    from pagedserve.errors import InvalidRequestError

    for bad in ("{{{not json", "[1, 2]", '{"a": 1'):  # (each was written as a call of no arguments)
        with pytest.raises(InvalidRequestError, match="not a JSON object"):
            parser.format_calls([type(calls[0])("f", bad)])
    assert parser.text_before_calls(" [f(") == 0 and parser.text_before_calls("Hello") == 5


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(["", " ", "<|python_start|>"]),
       st.lists(st.sampled_from(['[f(x=1)]', '[g(q="a, b"), h()]', "Plain [text].", " ok", "[", ""]), max_size=3),
       st.lists(st.integers(0, 80), max_size=6))
def test_pythonic_streamed_equals_whole(head: str, pieces: list[str], cuts: list[int]) -> None:
    from pagedserve.entrypoints.openai.tool_parsers import PythonicToolParser

    text = head + "".join(pieces)
    plan = ToolPlan(mode="auto", parser=PythonicToolParser(), names=NAMES)
    whole, calls = plan.calls(text, True)
    content, names = _streamed(plan, text, cuts)
    assert content == (whole or "") and names == [c.name for c in calls], (text, cuts)


REQUIRED = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]'


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, len(REQUIRED)), max_size=10))
def test_required_calls_stream_as_each_closes(cuts: list[int]) -> None:
    """A "required" answer's calls: each sent once its object closes (they all came when
    the array ended), the same calls as the whole answer's."""
    plan = ToolPlan(mode="required")
    content, names = _streamed(plan, REQUIRED, cuts)
    assert content == "" and names == ["get_weather", "get_time"]
    first_closed = REQUIRED.index("}}") + 2
    ts = ToolStream()
    out = CompletionOutput(0, REQUIRED[:first_closed + 3], [], finish_reason=None)  # (the second one begun)
    sent = [tc.function.name for ch in OpenAIServingChat._tool_deltas(None, plan, ts, out)
            for tc in ch.delta.tool_calls or []]
    assert sent == ["get_weather"]


def test_only_the_requests_functions_are_called_and_a_json_answer_is_no_call() -> None:
    """A JSON answer with a "name" (a schema's person, beside tools under "auto") was read by
    llama3_json as a call of the function "Alice" with no arguments; a call of a function the
    request does not have, or with arguments no strict JSON reader takes, is no call either."""
    from pagedserve.entrypoints.openai.tool_parsers import PythonicToolParser

    llama, hermes = ToolPlan(mode="auto", parser=Llama3JsonToolParser(), names=NAMES), \
        ToolPlan(mode="auto", parser=HermesToolParser(), names=NAMES)
    for text in ('{"name": "Alice", "age": 30}', '{"name": "f"}', '{"name": "nope", "parameters": {}}',
                 '{"name": "f", "parameters": {}}; {"name": "nope", "parameters": {}}',
                 '{"name": "f", "parameters": {"a": Infinity}}', '{"name": "f", "parameters": {"a": NaN}}'):
        assert llama.calls(text, True) == (text, []), text
        assert _streamed(llama, text, [3, 9]) == (text, []), text
    assert llama.calls('{"name": "f", "arguments": {"a": 1}}', True)[1][0].arguments == '{"a": 1}'
    assert hermes.calls('<tool_call>{"name": "nope", "arguments": {}}</tool_call>', True)[1] == []
    assert hermes.calls('<tool_call>{"name": "f", "arguments": {"a": NaN}}</tool_call>', True)[1] == []
    assert hermes.calls('<tool_call>{"name": "f"}</tool_call>', True)[1][0].arguments == "{}"  # (tags say it is one)
    pythonic = ToolPlan(mode="auto", parser=PythonicToolParser(), names=NAMES)
    assert pythonic.calls("[f(x=1), nope()]", True) == ("[f(x=1), nope()]", [])


@pytest.mark.parametrize(("parser", "text"), [
    (Llama3JsonToolParser(), '{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}'),
    ("pythonic", "[f(x=1), g()]"),
    (HermesToolParser(), CALL + CALL.replace("get_weather", "get_time")),
])
def test_parallel_tool_calls_false_keeps_only_the_first_call(parser, text: str) -> None:
    """llama3_json and pythonic have no structural tag to stop after the first call: the rest
    were all returned under parallel_tool_calls false (Anthropic's disable_parallel_tool_use)."""
    from pagedserve.entrypoints.openai.tool_parsers import PythonicToolParser

    parser = PythonicToolParser() if parser == "pythonic" else parser
    many, one = (ToolPlan(mode="auto", parser=parser, names=NAMES, one_call=k) for k in (False, True))
    assert len(many.calls(text, True)[1]) == 2
    (call,) = one.calls(text, True)[1]
    assert _streamed(one, text, [len(text) // 2])[1] == [call.name]

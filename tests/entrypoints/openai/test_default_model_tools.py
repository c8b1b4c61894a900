"""Agents' default: `tools` without `tool_choice` ("auto") against `pagedserve serve` on
the default model with no tool flags.  SmolLM2's chat template does not render tools
and no --tool-call-parser is given: the server picks hermes from the vocabulary, tells
the model about the tools in a system block, and reads calls back in that format."""

from __future__ import annotations

import json

import openai
import pytest
from conftest import ServerProcess

from pagedserve.entrypoints.openai.tool_parsers import (
    HermesToolParser,
    Llama3JsonToolParser,
    default_tool_parser,
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def smollm2_server(smollm2_path, tmp_path_factory):
    proc = ServerProcess([smollm2_path, "--served-model-name", "smol", "--enforce-eager", "--max-model-len", "2048"],
                         tmp_path_factory.mktemp("log") / "server.log")
    yield proc
    proc.stop()


def test_tools_with_tool_choice_omitted_work_on_the_default_model(smollm2_server):
    client = openai.OpenAI(base_url=smollm2_server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "What is the weather in Paris right now?"}]
    r = client.chat.completions.create(model="smol", messages=messages, tools=[WEATHER], max_tokens=64,
                                       temperature=0)
    (choice,) = r.choices
    assert choice.finish_reason in ("stop", "tool_calls", "length")
    for call in choice.message.tool_calls or []:  # whatever it chose, a call is well-formed
        assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments), dict)
    assert choice.message.tool_calls or choice.message.content
    # The model was told about the tool: the prompt is longer than without it.
    plain = client.chat.completions.create(model="smol", messages=messages, max_tokens=1)
    assert r.usage.prompt_tokens > plain.usage.prompt_tokens + 40
    log = smollm2_server.log()
    assert "the hermes format" in log and "does not render tools" in log
    # The deprecated spelling takes the same path.
    legacy = client.chat.completions.create(model="smol", messages=messages, functions=[WEATHER["function"]],
                                            max_tokens=8)
    assert legacy.usage.prompt_tokens == r.usage.prompt_tokens


def test_tools_beside_a_response_format_as_openai_takes_them(smollm2_server):
    """Agents send tools ("auto") and an output schema together: the answer is the schema's
    JSON or calls (tools were never called: the schema alone ruled); a forced call beside
    a schema is the call (it was a 400)."""
    client = openai.OpenAI(base_url=smollm2_server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    fmt = {"type": "json_schema", "json_schema": {"name": "out", "strict": True, "schema": {
        "type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"]}}}
    seen = set()
    for question in ("What is the weather in Paris right now? Use the tool.", "Is Paris in France? Answer yes or no.",
                     "Call get_weather for Rome.", "Say no."):
        r = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": question}],
                                           tools=[WEATHER], response_format=fmt, max_tokens=48, temperature=0)
        message = r.choices[0].message
        if message.tool_calls:
            seen.add("call")
            assert all(c.function.name == "get_weather" and "city" in json.loads(c.function.arguments)
                       for c in message.tool_calls)
        else:
            seen.add("answer")
            assert json.loads(message.content)["answer"] in ("yes", "no")
    assert "call" in seen  # (greedy SmolLM2 calls the tool for these; test_backends covers the answer branch)
    forced = client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "Weather in Rome?"}], tools=[WEATHER], response_format=fmt,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=48, temperature=0)
    assert forced.choices[0].message.tool_calls[0].function.name == "get_weather"


def test_a_past_call_is_in_the_prompt_under_a_template_that_renders_none(smollm2_server, smollm2_path):
    """SmolLM2's template drops an assistant turn's tool_calls: the server writes them into
    the turn in the parser's format, whatever this request's tool_choice, else the model
    answers the tool result without knowing what it called."""
    import httpx
    from transformers import AutoTokenizer

    history = [{"role": "user", "content": "What is the weather in Paris right now?"},
               {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                   "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    # (and OpenAI's deprecated spelling of the same turn: its function_call was left out)
    legacy = [history[0], {"role": "assistant", "content": None, "function_call": history[1]["tool_calls"][0]["function"]},
              {"role": "function", "name": "get_weather", "content": "sunny, 21 C"}]
    for extra in ({"tools": [WEATHER]}, {"tools": [WEATHER], "tool_choice": "none"}, {}, {"legacy": True}):
        messages = legacy if extra.pop("legacy", False) else history
        ids = httpx.post(smollm2_server.url + "/tokenize", timeout=60,
                         json={"model": "smol", "messages": messages, **extra}).json()["tokens"]
        prompt = tok.decode(ids)
        assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt, extra


def test_forced_tool_choices_describe_the_tools_under_a_template_that_renders_none(smollm2_server, smollm2_path):
    """tool_choice "required" or a named function fixes the answer's form by grammar; the
    model still has to be told what the functions are for (it filled them blind before),
    in the system message, in the form the grammar asks for.  Anthropic's "any" and "tool"
    are those two."""
    import anthropic
    import httpx
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    messages = [{"role": "user", "content": "What is the weather in Paris right now?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice, form in (("required", "a JSON array of calls"), (named, "its arguments, as a JSON object")):
        ids = httpx.post(smollm2_server.url + "/tokenize", timeout=60, json={
            "model": "smol", "messages": messages, "tools": [WEATHER], "tool_choice": choice}).json()["tokens"]
        prompt = tok.decode(ids)
        assert "Current weather of a city" in prompt and form in prompt, choice
        assert prompt.index("Current weather") < prompt.index("What is the weather in Paris")
    client = anthropic.Anthropic(base_url=smollm2_server.url, api_key="none", max_retries=0, timeout=120)
    tool = {"name": "get_weather", "description": "Current weather of a city",
            "input_schema": WEATHER["function"]["parameters"]}
    counts = {}
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}, None):
        m = client.messages.create(model="smol", max_tokens=32, messages=messages, tools=[tool],
                                   **({"tool_choice": choice} if choice else {}), extra_body={"temperature": 0})
        counts[None if choice is None else choice["type"]] = m.usage.input_tokens + m.usage.cache_read_input_tokens
        if choice is not None:
            (call,) = [b for b in m.content if b.type == "tool_use"][:1]
            assert call.name == "get_weather" and isinstance(call.input["city"], str)
    usage = client.messages.create(model="smol", max_tokens=1, messages=messages).usage
    plain = usage.input_tokens + usage.cache_read_input_tokens
    assert min(counts.values()) > plain + 40, (counts, plain)


def test_the_responses_and_messages_apis_on_the_default_model(smollm2_server):
    """OpenAI's Responses API and Anthropic's Messages API answer like the chat API on the
    default model: the same greedy text, streamed or not, and a forced function call."""
    import anthropic

    client = openai.OpenAI(base_url=smollm2_server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    ask = "What is the capital of France?"
    chat = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": ask}], max_tokens=16,
                                          temperature=0).choices[0].message.content
    r = client.responses.create(model="smol", input=ask, max_output_tokens=16, temperature=0)
    assert r.output_text == chat and "Paris" in chat
    with client.responses.stream(model="smol", input=ask, max_output_tokens=16, temperature=0) as stream:
        assert "".join(e.delta for e in stream if e.type == "response.output_text.delta") == chat
    tool = {"type": "function", **WEATHER["function"]}
    called = client.responses.create(model="smol", input="What is the weather in Paris right now?", tools=[tool],
                                     tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=32,
                                     temperature=0)
    (call,) = [item for item in called.output if item.type == "function_call"]
    assert call.name == "get_weather" and isinstance(json.loads(call.arguments)["city"], str)
    messages = anthropic.Anthropic(base_url=smollm2_server.url, api_key="none", max_retries=0, timeout=120)
    m = messages.messages.create(model="smol", max_tokens=16, messages=[{"role": "user", "content": ask}],
                                 extra_body={"temperature": 0})
    assert m.content[0].text == chat


class _Vocab:
    def __init__(self, *tokens: str) -> None:
        self.tokens = {t: i for i, t in enumerate(tokens)}

    def get_vocab(self) -> dict[str, int]:
        return self.tokens


def test_the_default_parser_follows_the_vocabulary():
    assert isinstance(default_tool_parser(_Vocab("a", "<|python_tag|>"))[0], Llama3JsonToolParser)
    assert isinstance(default_tool_parser(_Vocab("a", "<tool_call>"))[0], HermesToolParser)
    parser, why = default_tool_parser(_Vocab("a"))
    assert isinstance(parser, HermesToolParser) and "most common" in why
    block = HermesToolParser().tools_system_prompt([WEATHER])
    assert '"get_weather"' in block and "<tool_call>" in block


def test_tool_text_joins_a_system_message_of_parts(smollm2_path) -> None:
    """A system message sent as text parts got a second system message before it (Gemma's
    template then refused the conversation: roles must alternate)."""
    from transformers import AutoTokenizer

    from pagedserve.engine.chat_utils import render_chat
    from pagedserve.entrypoints.openai.protocol import ChatMessage
    from pagedserve.entrypoints.openai.serving_chat import with_system_text

    parts = [ChatMessage(role="system", content=[{"type": "text", "text": "SYS"}]), ChatMessage(role="user", content="hi")]
    out = with_system_text(parts, "TOOLS")
    assert [m.role for m in out] == ["system", "user"]
    assert out[0].content == [{"type": "text", "text": "SYS\n\nTOOLS"}]
    assert parts[0].content == [{"type": "text", "text": "SYS"}]  # (the request's own message unchanged)
    assert with_system_text([ChatMessage(role="system", content="S")], "T")[0].content == "S\n\nT"
    # rendered as a vision model renders (content parts kept) by a template that reads a
    # message's first part, as Gemma 3's does: the tools are in the prompt (a new part was not)
    first_part = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] if m['content'] is string "
                  "else m['content'][0]['text'] }}\n{% endfor %}")
    conversation = [m.model_dump(exclude_unset=True) for m in out]
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    assert "SYS\n\nTOOLS" in render_chat(tok, first_part, conversation, content_parts=True)

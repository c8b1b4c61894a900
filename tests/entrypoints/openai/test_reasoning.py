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
from tests.engine.fake_engine import CharTokenizer, FakeEngine
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
       closed=st.booleans(), lead=st.sampled_from(["", " ", "\n", " \n "]))
def test_every_streamed_prefix_is_a_prefix_of_the_final_split(parser, reasoning, content, opened, closed,
                                                              lead) -> None:
    """Both parts only grow as characters arrive, and no tag ever shows in either (blank
    text before "<think>" was content until the tag came, then content shrank: a stream
    sent "\n" and lost the answer's first character)."""
    text = lead + ("<think>" if opened else "") + reasoning + ("</think>" + content if closed else "")
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


def _app(script: str, tool_parser: str | None = None, reasoning_parser=QWEN3):
    state = ServerState(served_model_names=["fake"])
    app = build_app(state)
    engine = FakeEngine(script=script)
    engine.max_model_len = 2048  # (the tools' system block is long in characters, its tokens here)
    state.attach(Attachment.local(AsyncLLM(engine, log_stats=False), 2048),
                 get_tool_parser(tool_parser) if tool_parser else None, reasoning_parser)
    return app


def _full_and_streamed(app, body: dict) -> tuple[dict, dict, dict]:
    """(the answer's message, its streamed content and its streamed reasoning joined) and
    the deltas' reasoning field names."""
    async def both(client):
        full = (await client.post("/v1/chat/completions", json=body)).json()
        streamed = (await client.post("/v1/chat/completions", json={**body, "stream": True})).text
        return full, streamed

    full, streamed = call(app, both)
    deltas = [e["choices"][0]["delta"] for e in events(streamed)[:-1] if e["choices"]]
    joined = {k: "".join(d.get(k) or "" for d in deltas) for k in ("content", "reasoning", "reasoning_content")}
    return full["choices"][0]["message"], joined, deltas


def test_the_prompts_own_block_decides_whatever_the_parser() -> None:
    """A prompt that closed the block (a continued message past its `</think>`, a template
    ending in one) makes the answer all content: deepseek_r1 put it all in the reasoning,
    a structured answer included.  One that opened it (a continued message inside its
    block) makes it reasoning up to `</think>`: qwen3 read it all as content."""
    body = {"model": "fake", "add_generation_prompt": False, "continue_final_message": True, "max_tokens": 6}
    closed = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>easy</think>It is"}]
    message, joined, _ = _full_and_streamed(_app(" four.", reasoning_parser=R1), {**body, "messages": closed})
    assert (message["content"], message["reasoning_content"]) == (" four.", None)
    assert (joined["content"], joined["reasoning_content"]) == (" four.", "")
    inside = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>Let me"}]
    body = {**body, "max_tokens": len(" see.</think>Four.")}
    message, joined, _ = _full_and_streamed(_app(" see.</think>Four.", reasoning_parser=QWEN3),
                                            {**body, "messages": inside})
    assert (message["reasoning_content"], message["content"]) == (" see.", "Four.")
    assert (joined["reasoning_content"], joined["content"]) == (" see.", "Four.")
    # a user quoting a tag says nothing of the answer's block
    quoted = [{"role": "user", "content": "what does <think> mean?"}]
    message, _, _ = _full_and_streamed(_app("A tag.", reasoning_parser=QWEN3),
                                       {"model": "fake", "messages": quoted, "max_tokens": 6})
    assert (message["content"], message["reasoning_content"]) == ("A tag.", None)


def test_reasoning_under_both_names_left_out_when_asked_and_content_null_without_an_answer() -> None:
    """vLLM's current `reasoning` beside `reasoning_content` (clients read either); vLLM's
    include_reasoning false leaves it out (it was ignored); an answer cut inside its
    thinking has content null, as vLLM's."""
    script = "<think>\nLet me see.\n</think>\n\nParis."
    body = {"model": "fake", "messages": [{"role": "user", "content": "capital?"}], "max_tokens": len(script)}
    message, joined, deltas = _full_and_streamed(_app(script), body)
    assert message["reasoning"] == message["reasoning_content"] == joined["reasoning"] == "\nLet me see.\n"
    assert joined["reasoning_content"] == joined["reasoning"]
    message, joined, deltas = _full_and_streamed(_app(script), {**body, "include_reasoning": False})
    assert message["reasoning"] is None and message["reasoning_content"] is None and message["content"] == "Paris."
    assert joined == {"content": "Paris.", "reasoning": "", "reasoning_content": ""}
    cut = {**body, "max_tokens": len("<think>\nLet me")}
    message, _, _ = _full_and_streamed(_app(script), cut)
    assert message["content"] is None and message["reasoning"] == "\nLet me"
    message, _, _ = _full_and_streamed(_app(script), {**cut, "include_reasoning": False})
    assert message["content"] is None and message["reasoning"] is None


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


# ------------------------------------------------------------------ a real tiny Qwen3
QWEN3_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif %}"
)


def make_chain_qwen3(path, ponder: bool = False) -> None:
    """A Qwen3 checkpoint that is a bigram machine: its layers add nothing (o_proj and
    down_proj zero), each token's embedding is one-hot, and the LM head maps token t to
    the logit of its successor, so greedy decoding follows a fixed chain:
    "\\n" -> <think> -> hmm -> </think> -> Paris -> <|im_end|> (`ponder`: hmm -> hmm, a
    model that thinks forever).  The think tokens are
    added, not special, as in Qwen3's own vocabulary (skip_special_tokens keeps them)."""
    import torch
    import transformers

    from tests.entrypoints.openai.conftest import train_tokenizer

    tok = train_tokenizer(["user assistant system: what is the capital of France?"], 200,
                          ["<think>", "</think>", "hmm", "Paris", "Rome"])
    tok.chat_template = QWEN3_TEMPLATE
    ids = {t: tok.convert_tokens_to_ids(t) for t in ["<think>", "</think>", "hmm", "Paris", "<|im_end|>"]}
    newline = tok.encode("\n", add_special_tokens=False)
    assert len(newline) == 1
    chain = {newline[0]: ids["<think>"], ids["<think>"]: ids["hmm"], ids["hmm"]: ids["hmm" if ponder else "</think>"],
             ids["</think>"]: ids["Paris"], ids["Paris"]: ids["<|im_end|>"]}
    vocab = len(tok)
    cfg = transformers.Qwen3Config(
        vocab_size=vocab, hidden_size=vocab + (-vocab) % 8, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=256,
        tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.copy_(torch.eye(vocab, cfg.hidden_size))
        head = torch.zeros(vocab, cfg.hidden_size)
        for t in range(vocab):
            head[chain.get(t, ids["<|im_end|>"]), t] = 1.0
        model.lm_head.weight.copy_(head)
    model.save_pretrained(path)
    tok.save_pretrained(path)


def _chain_app(path, ponder: bool = False):
    """(an app serving make_chain_qwen3's model under the qwen3 reasoning parser, its
    engine, a greedy chat body)."""
    from pagedserve.engine.arg_utils import EngineArgs
    from pagedserve.engine.llm_engine import LLMEngine

    make_chain_qwen3(path, ponder)
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(path), dtype="float32", max_model_len=128,
                                                   kv_cache_memory_bytes="8MiB"))
    state = ServerState(served_model_names=["qwen3"])
    app = build_app(state)
    state.attach(Attachment.local(AsyncLLM(engine, log_stats=False), 128), None, QWEN3)
    body = {"model": "qwen3", "messages": [{"role": "user", "content": "capital of France?"}], "max_tokens": 16,
            "temperature": 0}
    return app, engine, body


def test_a_tiny_qwen3_thinks_apart_streamed_or_not_and_not_at_all_when_told(tmp_path) -> None:
    """Also under structured outputs: the grammar starts after the reasoning."""
    app, engine, body = _chain_app(tmp_path)

    no_thinking = {"chat_template_kwargs": {"enable_thinking": False}}
    rome = {"structured_outputs": {"choice": ["Rome"]}}  # what the chain would not say

    async def run(client):
        async def post(extra: dict) -> dict:
            return (await client.post("/v1/chat/completions", json={**body, **extra})).json()

        full = await post({})
        streamed = (await client.post("/v1/chat/completions", json={**body, "stream": True})).text
        return full, streamed, await post(no_thinking), await post(rome), await post({**rome, **no_thinking})

    try:
        full, streamed, plain, constrained, constrained_plain = call(app, run)
    finally:
        engine.shutdown()
    message = full["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("hmm", "Paris"), full
    assert full["choices"][0]["finish_reason"] == "stop"
    deltas = [e["choices"][0]["delta"] for e in events(streamed)[:-1] if e["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "hmm"
    assert "".join(d.get("content") or "" for d in deltas) == "Paris"
    assert plain["choices"][0]["message"]["content"] == "Paris"  # the template closed an empty block
    assert plain["choices"][0]["message"]["reasoning_content"] is None
    # Under a grammar the model still thinks first; the grammar takes over after </think>,
    # or from the first token when the prompt closed the block.
    message = constrained["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("hmm", "Rome"), constrained
    message = constrained_plain["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (None, "Rome"), constrained_plain


def test_a_thinking_budget_ends_the_thinking_and_the_answer_follows(tmp_path) -> None:
    """A model that would think forever: under vLLM's thinking_token_budget (chat) or
    Anthropic's budget_tokens its thinking is that many tokens, then "</think>" is forced
    and the answer follows, streamed alike; without one it thinks to max_tokens."""
    app, engine, body = _chain_app(tmp_path, ponder=True)
    anthropic = {"model": "qwen3", "messages": body["messages"], "max_tokens": 16}

    async def run(client):
        async def chat(extra: dict) -> dict:
            return (await client.post("/v1/chat/completions", json={**body, **extra})).json()

        async def messages(thinking: dict) -> dict:
            return (await client.post("/v1/messages", json={**anthropic, "thinking": thinking})).json()

        streamed = (await client.post("/v1/chat/completions",
                                      json={**body, "stream": True, "thinking_token_budget": 3})).text
        quoted = await chat({"thinking_token_budget": 3, "messages": [{"role": "user", "content": "<think>?"}]})
        refusals = [(await client.post("/v1/completions", json={
            "model": "qwen3", "max_tokens": 8, "thinking_token_budget": 2, **extra})).json() for extra in (
            {"prompt": "x\n<think>", "structured_outputs": {"json": {"type": "object"}}},  # (no parser: at once)
            {"prompt": "x", "bad_words": ["</think>"]}, {"prompt": "x", "allowed_token_ids": [5, 6]})]
        return (await chat({}), await chat({"thinking_token_budget": 3}), await chat({"thinking_token_budget": 0}),
                streamed, await messages({"type": "enabled", "budget_tokens": 2}),
                await messages({"type": "enabled", "budget_tokens": 2, "display": "omitted"}), quoted, refusals)

    try:
        free, three, none, streamed, blocks, omitted, quoted, refusals = call(app, run)
    finally:
        engine.shutdown()
    # A user's text quoting the tag opens no block for the answer (it forced "</think>" into
    # the content, and counted the model's own "<think>" as thinking)
    message = quoted["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("hmm" * 3, "Paris"), quoted
    # What would forbid the forced end tag is refused up front (it failed mid-answer)
    assert [r["error"]["param"] for r in refusals] == ["thinking_token_budget"] * 3, refusals
    assert "under a grammar that starts at once" in refusals[0]["error"]["message"]
    assert "which bad_words forbid" in refusals[1]["error"]["message"]
    assert "which allowed_token_ids leave out" in refusals[2]["error"]["message"]
    message = free["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"], free["choices"][0]["finish_reason"]) == (
        "hmm" * 15, None, "length")
    message = three["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"], three["choices"][0]["finish_reason"]) == (
        "hmm" * 3, "Paris", "stop"), three
    assert none["choices"][0]["message"]["content"] == "Paris" and not none["choices"][0]["message"]["reasoning_content"]
    deltas = [e["choices"][0]["delta"] for e in events(streamed)[:-1] if e["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "hmm" * 3
    assert "".join(d.get("content") or "" for d in deltas) == "Paris"
    assert blocks["content"] == [{"type": "thinking", "thinking": "hmm" * 2, "signature": ""},
                                 {"type": "text", "text": "Paris"}], blocks
    assert [b.get("thinking", b.get("text")) for b in omitted["content"]] == ["", "Paris"]


def test_anthropic_thinking_needs_a_reasoning_parser() -> None:
    """Without --reasoning-parser an answer has no thinking blocks to give (a budget on a
    model without <think> tokens: tests/entrypoints/openai/test_request_fields.py)."""
    async def run(client):
        return (await client.post("/v1/messages", json={"model": "fake", "max_tokens": 8, "thinking": {
            "type": "adaptive"}, "messages": [{"role": "user", "content": "x"}]})).json()

    answer = call(_app("x", reasoning_parser=None), run)
    assert "needs a thinking model served with --reasoning-parser" in answer["error"]["message"], answer


def test_a_parser_over_a_tokenizer_without_the_end_token_is_said_at_start(caplog) -> None:
    """vLLM refuses such a parser; this one splits by text, and says what that costs
    (under a grammar the answer is all content): it started without a word."""
    import logging

    with caplog.at_level(logging.WARNING, logger="pagedserve"):
        _app("x")  # (the scripted engine's tokenizer is by characters: no </think> token)
    assert any("has no </think> token" in r.getMessage() for r in caplog.records)


def test_a_streamed_response_opens_and_closes_each_items_content_part() -> None:
    """The Responses stream: a reasoning item's text goes in a `reasoning_text` content
    part announced and closed like the message's `output_text` one (its deltas named a
    part never added); every event parses as the SDK's typed events."""
    import pydantic
    from openai.types.responses import ResponseStreamEvent

    script = "<think>Let me see.</think>Paris."
    body = {"model": "fake", "input": "capital?", "max_output_tokens": len(script), "stream": True}
    text = call(_app(script), lambda client: client.post("/v1/responses", json=body)).text
    raw = [json.loads(block.split("data: ", 1)[1]) for block in text.split("\n\n") if block.strip()]
    parsed = [pydantic.TypeAdapter(ResponseStreamEvent).validate_python(e) for e in raw]
    assert [e.sequence_number for e in parsed] == list(range(len(parsed)))
    kinds = [(e["type"], e.get("part", {}).get("type")) for e in raw if "delta" not in e]
    item = ["response.output_item.added", "response.content_part.added", "{}.done", "response.content_part.done",
            "response.output_item.done"]
    want = [(k.format("response.reasoning_text"), "reasoning_text" if "part" in k else None) for k in item]
    want += [(k.format("response.output_text"), "output_text" if "part" in k else None) for k in item]
    assert kinds[2:-1] == want, kinds
    parts = {(e["item_id"], e["content_index"]) for e in raw if e["type"] == "response.content_part.added"}
    assert all((e["item_id"], e["content_index"]) in parts for e in raw if "delta" in e)
    final = raw[-1]["response"]
    assert [i["content"][0]["text"] for i in final["output"]] == ["Let me see.", "Paris."]
    assert final["service_tier"] == "default" and final["background"] is False


def test_a_named_call_after_thinking_streams_in_the_order_of_the_whole_answer() -> None:
    """Under a named tool choice the chat stream names the call at once; with a reasoning
    parser the model thinks first, so the ordered APIs hold the call to the end: a
    Responses stream announced the call's item before the reasoning one, and Anthropic's a
    tool_use block before the thinking block, where the whole answers have them after."""
    class ThinkingChars(CharTokenizer):  # (the grammar starts on a single end-of-thinking token)
        def convert_tokens_to_ids(self, token: str) -> int | None:
            return 255 if token == "</think>" else super().convert_tokens_to_ids(token)

    script = '<think>hm</think>{"a": 1}'
    state = ServerState(served_model_names=["fake"])
    app = build_app(state)
    engine = FakeEngine(script=script, step_time=0.005)  # (one character a step, read as it comes)
    engine.tokenizer = ThinkingChars()
    state.attach(Attachment.local(AsyncLLM(engine, log_stats=False), 4096), None, QWEN3)
    tool = {"name": "f", "parameters": {"type": "object"}}
    user = [{"role": "user", "content": "x"}]
    responses = {"model": "fake", "input": user, "tools": [{"type": "function", **tool}],
                 "tool_choice": {"type": "function", "name": "f"}, "max_output_tokens": len(script)}
    messages = {"model": "fake", "messages": user, "max_tokens": len(script), "tool_choice": {"type": "tool", "name": "f"},
                "tools": [{"name": "f", "input_schema": {"type": "object"}}]}

    async def fn(c):
        return [await c.post(path, json={**body, "stream": stream}) for path, body in (
            ("/v1/responses", responses), ("/v1/messages", messages)) for stream in (False, True)]

    whole_r, streamed_r, whole_m, streamed_m = call(app, fn)
    assert [i["type"] for i in whole_r.json()["output"]] == ["reasoning", "function_call"], whole_r.text
    frames = [json.loads(b.split("data: ", 1)[1]) for b in streamed_r.text.split("\n\n") if "data: " in b]
    added = [f["item"]["type"] for f in frames if f["type"] == "response.output_item.added"]
    assert added == ["reasoning", "function_call"], added
    assert frames[-1]["response"]["output"][1]["arguments"] == whole_r.json()["output"][1]["arguments"] == '{"a": 1}'
    assert whole_m.status_code == 200, whole_m.text
    assert [b["type"] for b in whole_m.json()["content"]] == ["thinking", "tool_use"], whole_m.text
    started = [json.loads(b.split("data: ", 1)[1])["content_block"]["type"] for b in streamed_m.text.split("\n\n")
               if "content_block_start" in b]
    assert started == ["thinking", "tool_use"], started

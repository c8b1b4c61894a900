"""The real server (subprocess, tiny random Llama) through the official openai client."""

from __future__ import annotations

import asyncio
import math

import httpx
import openai
import pytest
from conftest import API_KEY, MODEL_NAME
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.hypothesis_budget import examples

AUTH = {"Authorization": f"Bearer {API_KEY}"}

PROMPT = "the quick brown fox"
SPECIALS = {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}
MESSAGES = [{"role": "system", "content": "answer briefly."}, {"role": "user", "content": "hello world"}]


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60) as c:
        yield c


def complete(client, **kw):
    args = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 12, "temperature": 0.0, **kw}
    return client.completions.create(**args)


def test_models_health_version(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    one = client.models.retrieve(MODEL_NAME)  # GET /v1/models/{id}
    assert one.id == MODEL_NAME and one.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no/such-model")
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version", headers=AUTH).json()["version"]


def test_completion_usage_is_exact(client, tokenizer):
    r = complete(client, max_tokens=10, extra_body={"ignore_eos": True})
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.model == MODEL_NAME
    (choice,) = r.choices
    assert choice.index == 0 and choice.finish_reason == "length"
    n_prompt = len(tokenizer.encode(PROMPT))
    assert r.usage.prompt_tokens == n_prompt
    assert r.usage.completion_tokens == 10
    assert r.usage.total_tokens == n_prompt + 10
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


def test_chat_usage_is_exact(client, tokenizer):
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=7,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    (choice,) = r.choices
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason == "length"
    ids = tokenizer.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == 7 and r.usage.total_tokens == len(ids) + 7


def test_streamed_equals_non_streamed_completion(client):
    full = complete(client, max_tokens=24).choices[0]
    pieces, finishes = [], []
    for chunk in complete(client, max_tokens=24, stream=True):
        (c,) = chunk.choices
        pieces.append(c.text)
        finishes.append(c.finish_reason)
    assert "".join(pieces) == full.text
    assert finishes[-1] == full.finish_reason and all(f is None for f in finishes[:-1])


def test_streamed_equals_non_streamed_chat(client):
    kw = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 20, "temperature": 0}
    full = client.chat.completions.create(**kw).choices[0]
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(ch.id == chunks[0].id and ch.id.startswith("chatcmpl-") for ch in chunks)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks)
    assert text == full.message.content
    finishes = [ch.choices[0].finish_reason for ch in chunks]
    assert finishes[-1] == full.finish_reason and all(f is None for f in finishes[:-1])


def test_n3_with_seed_indices_and_reproducible(client):
    kw = {"n": 3, "seed": 1234, "temperature": 1.0, "max_tokens": 8}
    a = complete(client, **kw)
    b = complete(client, **kw)
    assert sorted(c.index for c in a.choices) == [0, 1, 2]
    assert [c.text for c in sorted(a.choices, key=lambda c: c.index)] == \
           [c.text for c in sorted(b.choices, key=lambda c: c.index)]
    # Streamed, each index gets exactly one finish_reason, in its last chunk.
    seen: dict[int, list] = {0: [], 1: [], 2: []}
    for chunk in complete(client, stream=True, **kw):
        for c in chunk.choices:
            seen[c.index].append(c.finish_reason)
    for reasons in seen.values():
        assert reasons and reasons[-1] is not None and all(r is None for r in reasons[:-1])


def test_include_usage_chunk(client):
    chunks = list(complete(client, max_tokens=6, stream=True, stream_options={"include_usage": True},
                           extra_body={"ignore_eos": True}))
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 6
    assert last.usage.total_tokens == last.usage.prompt_tokens + 6
    assert all(ch.usage is None for ch in chunks[:-1])
    chat_chunks = list(client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=5, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True}))
    assert chat_chunks[-1].choices == [] and chat_chunks[-1].usage.completion_tokens == 5


def test_completion_logprobs(client):
    r = complete(client, max_tokens=8, logprobs=3, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    # Special tokens appear in the per-token list but not in the text (skip_special_tokens).
    assert "".join(t for t in lp.tokens if t not in SPECIALS) == r.choices[0].text
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for tok, tok_lp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert tok_lp <= 0 and 3 <= len(top) <= 4
        # Greedy: the chosen token is the most likely one.
        assert tok_lp == pytest.approx(max(top.values()), abs=1e-4)
        assert top[tok] == pytest.approx(tok_lp, abs=1e-6)


def test_chat_logprobs_and_streamed_logprobs(client):
    kw = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 6, "temperature": 0, "logprobs": True,
          "top_logprobs": 2, "extra_body": {"ignore_eos": True}}
    r = client.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert len(content) == 6
    assert "".join(t.token for t in content if t.token not in SPECIALS) == r.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
        assert t.logprob == pytest.approx(t.top_logprobs[0].logprob, abs=1e-4)
        assert t.bytes == list(t.token.encode())
    streamed = [t for ch in client.chat.completions.create(stream=True, **kw)
                if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.content]
    assert [(t.token, round(t.logprob, 4)) for t in streamed] == [(t.token, round(t.logprob, 4)) for t in content]


def test_stop_strings(client):
    base = complete(client, max_tokens=30, extra_body={"ignore_eos": True}).choices[0].text
    assert len(base) > 8, base
    stop = base[5:8]
    expected = base[: base.find(stop)]
    r = complete(client, max_tokens=30, stop=[stop], extra_body={"ignore_eos": True}).choices[0]
    assert r.text == expected and r.finish_reason == "stop" and r.stop_reason == stop
    streamed = list(complete(client, max_tokens=30, stop=[stop], stream=True, extra_body={"ignore_eos": True}))
    text = "".join(ch.choices[0].text for ch in streamed)
    assert text == expected  # no part of the stop string leaked into any chunk
    assert streamed[-1].choices[0].finish_reason == "stop"
    inc = complete(client, max_tokens=30, stop=[stop], extra_body={"ignore_eos": True,
                                                                  "include_stop_str_in_output": True})
    assert inc.choices[0].text == expected + stop


def test_prompt_forms_and_echo(client, tokenizer):
    ids = tokenizer.encode(PROMPT)
    by_text = complete(client, max_tokens=5)
    by_ids = complete(client, prompt=ids, max_tokens=5)
    assert by_ids.choices[0].text == by_text.choices[0].text
    batch = complete(client, prompt=[PROMPT, "hello world"], max_tokens=5)
    assert [c.index for c in sorted(batch.choices, key=lambda c: c.index)] == [0, 1]
    assert sorted(batch.choices, key=lambda c: c.index)[0].text == by_text.choices[0].text
    echo = complete(client, max_tokens=5, echo=True)
    assert echo.choices[0].text == PROMPT + by_text.choices[0].text


def test_chat_echo_puts_the_final_assistant_turn_first(client):
    """vLLM's chat `echo`: a final assistant turn (continued) comes before the answer, whole
    and streamed, for every choice; a final user turn has nothing to echo; text parts join
    with newlines."""
    def chat(messages, **kw):
        return client.chat.completions.create(model=MODEL_NAME, messages=messages, max_completion_tokens=5,
                                              temperature=0, **kw)

    turn = [*MESSAGES, {"role": "assistant", "content": "Well,"}]
    cont = {"continue_final_message": True, "add_generation_prompt": False}
    plain = chat(turn, extra_body=cont).choices[0].message.content
    assert chat([{"role": "user", "content": "Once upon a"}], extra_body=cont).choices[0].finish_reason  # (was a 400)
    echoed = chat(turn, n=2, extra_body={**cont, "echo": True})
    assert [c.message.content for c in echoed.choices] == ["Well," + plain] * 2
    pieces: dict[int, str] = {}
    for ch in chat(turn, n=2, stream=True, extra_body={**cont, "echo": True}):
        for c in ch.choices:
            pieces[c.index] = pieces.get(c.index, "") + (c.delta.content or "")
    assert pieces == {0: "Well," + plain, 1: "Well," + plain}
    assert chat(MESSAGES, extra_body={"echo": True}).choices[0].message.content == \
        chat(MESSAGES).choices[0].message.content
    parts = [*MESSAGES, {"role": "assistant", "content": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}]}]
    assert chat(parts, extra_body={**cont, "echo": True}).choices[0].message.content.startswith("A\nB")


def test_errors_then_success(server, client):
    # 400: validation (our own and pydantic's), context length in vLLM's words.
    with pytest.raises(openai.BadRequestError) as e:
        complete(client, temperature=-1)
    assert e.value.status_code == 400 and "temperature" in e.value.body["message"]
    assert complete(client, max_tokens=2).choices[0].text is not None
    with pytest.raises(openai.BadRequestError) as e:
        complete(client, max_tokens="lots")
    assert e.value.status_code == 400
    n_prompt = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}, headers=AUTH).json()["count"]
    with pytest.raises(openai.BadRequestError) as e:
        complete(client, max_tokens=300)
    assert e.value.body["message"] == (
        f"This model's maximum context length is 256 tokens. However, you requested {n_prompt + 300} tokens "
        f"({n_prompt} in the messages, 300 in the completion). Please reduce the length of the messages or "
        "completion.")
    assert e.value.body["param"] == "max_tokens"  # a smaller max_tokens would fit
    with pytest.raises(openai.BadRequestError) as e:  # the prompt alone fills the context: it is named
        complete(client, prompt=PROMPT * (300 // n_prompt + 2), max_tokens=1)
    assert e.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as e:  # (named as the client spelled it: it said max_tokens)
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                       max_completion_tokens=300)
    assert e.value.body["param"] == "max_completion_tokens"
    assert complete(client, max_tokens=2).usage.completion_tokens >= 1
    # 401: wrong key.
    with openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError) as e:
            bad.models.list()
    assert e.value.status_code == 401
    assert complete(client, max_tokens=2).choices
    # 404: unknown model.
    with pytest.raises(openai.NotFoundError) as e:
        complete(client, model="gpt-4")
    assert e.value.status_code == 404 and "gpt-4" in e.value.body["message"]
    assert complete(client, max_tokens=2).choices


def test_tokenize_detokenize(server, tokenizer):
    r = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}, headers=AUTH).json()
    assert r["tokens"] == tokenizer.encode(PROMPT) and r["count"] == len(r["tokens"]) and r["max_model_len"] == 256
    d = httpx.post(server.url + "/detokenize", json={"tokens": r["tokens"]}, headers=AUTH).json()
    assert d["prompt"] == tokenizer.decode(r["tokens"])
    # Messages with tools count the prompt chat would run (the tools shown to the model)
    messages = [{"role": "user", "content": "weather in Paris?"}]
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    counted = [httpx.post(server.url + "/tokenize", json={"messages": messages, **extra}, headers=AUTH).json()["count"]
               for extra in ({}, {"tools": [tool]}, {"tools": [tool], "tool_choice": "none"})]
    ran = [httpx.post(server.url + CHAT_URL, headers=AUTH, timeout=60, json={
        "model": MODEL_NAME, "messages": messages, "max_tokens": 1, **extra}).json()["usage"]["prompt_tokens"]
        for extra in ({}, {"tools": [tool]}, {"tools": [tool], "tool_choice": "none"})]
    assert counted == ran and counted[1] > counted[0] == counted[2]
    # What the routes do not do is refused by name, not dropped; a chat field's error names it;
    # /detokenize takes a list longer than the context (/tokenize gives them)
    for body, param in [({"prompt": PROMPT, "tools": [tool]}, "tools"),
                        ({"prompt": PROMPT, "add_generation_prompt": False}, "add_generation_prompt"),
                        ({"prompt": PROMPT, "use_beam_search": True}, "use_beam_search"),
                        ({"messages": messages, "mm_processor_kwargs": {"num_crops": 4}}, "mm_processor_kwargs"),
                        ({"messages": messages, "tools": [{"type": "function"}]}, "tools")]:
        bad = httpx.post(server.url + "/tokenize", json=body, headers=AUTH)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text
        assert "validation error" not in bad.json()["error"]["message"]
    long = httpx.post(server.url + "/detokenize", json={"tokens": r["tokens"] * 100}, headers=AUTH)
    assert long.status_code == 200 and long.json()["prompt"] == tokenizer.decode(r["tokens"] * 100)


def test_async_client_concurrent(server):
    async def main():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0) as ac:
            kw = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 10, "temperature": 0}
            results = await asyncio.gather(*(ac.completions.create(**kw) for _ in range(6)))
            stream = await ac.completions.create(stream=True, **kw)
            streamed = "".join([ch.choices[0].text async for ch in stream])
            return [r.choices[0].text for r in results], streamed

    texts, streamed = asyncio.run(main())
    assert len(set(texts)) == 1 and streamed == texts[0]


CHAT_URL, COMPLETIONS_URL = "/v1/chat/completions", "/v1/completions"


def _post(server, url: str, body: dict) -> httpx.Response:
    # Sent as raw text: json.dumps writes NaN / Infinity literals, which Python's parser accepts.
    import json

    return httpx.post(server.url + url, content=json.dumps(body), timeout=60,
                      headers={**AUTH, "Content-Type": "application/json"})


def _chat(**kw) -> dict:
    return {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 2, **kw}


def test_non_finite_sampling_values_are_400s_and_the_server_lives_on(server):
    for field, value in [("temperature", "NaN"), ("temperature", "Infinity"), ("top_p", "NaN"),
                         ("presence_penalty", "NaN")]:
        r = _post(server, CHAT_URL, _chat(**{field: value}))
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == field and field in err["message"] and err["type"] == "invalid_request_error"
        ok = _post(server, CHAT_URL, _chat())
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] is not None
    assert httpx.get(server.url + "/health").status_code == 200


HOSTILE = st.sampled_from([math.nan, math.inf, -math.inf, "NaN", "Infinity", "-Infinity", 1e308, -1e308,
                           10**30, -(10**30), -1, 0, "abc", [], {}, None, True])
REQUEST_NUMBERS = ["temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "max_tokens", "min_tokens", "n", "priority", "stop_token_ids"]


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(chat=st.booleans(), field=st.sampled_from(REQUEST_NUMBERS + ["logprobs", "top_logprobs",
                                                                    "max_completion_tokens", "best_of"]),
       value=HOSTILE, stream=st.booleans())
def test_hostile_request_numbers_get_400_or_200_never_5xx(server, chat, field, value, stream):
    if field == "stop_token_ids" and not isinstance(value, list):
        value = [value]
    body = _chat(stream=stream) if chat else {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 2,
                                              "stream": stream}
    if chat and field == "logprobs" and not isinstance(value, bool):
        body["top_logprobs"] = value
        body["logprobs"] = True
    else:
        body[field] = value
    r = _post(server, CHAT_URL if chat else COMPLETIONS_URL, body)
    assert r.status_code in (200, 400), (field, value, r.status_code, r.text)
    if r.status_code == 400:
        assert r.json()["error"]["message"]
    elif stream:
        assert '"error"' not in r.text, r.text  # accepted means it ran: no in-band failure
    assert _post(server, COMPLETIONS_URL, {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize("field,value", [
    ("guided_whitespace_pattern", r"[ ]?"),
    ("guided_decoding_backend", "outlines"),
    ("priority", 1),
])
def test_fields_we_cannot_honour_are_refused_not_ignored(server, field, value):
    for stream in (False, True):
        r = _post(server, CHAT_URL, _chat(stream=stream, **{field: value}))
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == field
    if field == "priority":
        assert r.json()["error"]["message"] == "Got priority 1 but Priority scheduling is not enabled."
    assert _post(server, CHAT_URL, _chat(response_format={"type": "text"})).status_code == 200


def test_content_parts_render_as_llm_chat_renders_them(server, tokenizer):
    """One flattener: text parts joined by newlines on the server as in LLM.chat (the
    server once joined them with nothing, so the same messages made another prompt)."""
    parts = [{"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}]}]
    served = httpx.post(server.url + "/tokenize", json={"messages": parts}, headers=AUTH).json()["tokens"]
    expected = tokenizer.apply_chat_template([{"role": "user", "content": "hello\nworld"}], tokenize=False,
                                             add_generation_prompt=True)
    assert served == tokenizer.encode(expected, add_special_tokens=False)
    r = _post(server, CHAT_URL, {"model": MODEL_NAME, "max_tokens": 2,
                                 "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_echo_with_logprobs_and_prompt_logprobs(client, tokenizer):
    n_prompt = len(tokenizer.encode(PROMPT))
    r = complete(client, max_tokens=4, echo=True, logprobs=2, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == n_prompt + 4 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset) and r.choices[0].text.startswith(PROMPT)
    streamed = list(complete(client, max_tokens=4, echo=True, logprobs=2, stream=True,
                             extra_body={"ignore_eos": True}))
    first = streamed[0].choices[0]
    assert first.text == PROMPT and first.logprobs.token_logprobs[1:] == pytest.approx(
        lp.token_logprobs[1:n_prompt], abs=1e-4)
    plain = complete(client, max_tokens=2, extra_body={"prompt_logprobs": 1})
    plp = plain.choices[0].model_extra["prompt_logprobs"]
    assert len(plp) == n_prompt and plp[0] is None and all(len(step) >= 1 for step in plp[1:])
    # OpenAI's legacy way to score a prompt: echo with max_tokens 0, the prompt alone
    scored = complete(client, max_tokens=0, echo=True, logprobs=2)
    assert scored.choices[0].text == PROMPT and scored.choices[0].finish_reason == "length"
    assert scored.choices[0].logprobs.token_logprobs == pytest.approx(lp.token_logprobs[:n_prompt], abs=1e-4)
    assert (scored.usage.prompt_tokens, scored.usage.completion_tokens) == (n_prompt, 0)
    chunks = list(complete(client, max_tokens=0, echo=True, logprobs=2, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == PROMPT
    assert chunks[-1].choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        complete(client, max_tokens=0)  # (without echo there is nothing to answer)
    # logprobs=0 (no alternatives): still every echoed token's own logprob (the prompt's were left out)
    for max_tokens in (0, 4):
        zero = complete(client, max_tokens=max_tokens, echo=True, logprobs=0, extra_body={"ignore_eos": True})
        zlp = zero.choices[0].logprobs
        assert len(zlp.tokens) == n_prompt + max_tokens and zlp.tokens == lp.tokens[:n_prompt + max_tokens]
        assert zlp.token_logprobs == pytest.approx(lp.token_logprobs[:n_prompt + max_tokens], abs=1e-4)
        chunks = list(complete(client, max_tokens=max_tokens, echo=True, logprobs=0, stream=True,
                               extra_body={"ignore_eos": True}))
        assert sum((c.choices[0].logprobs.tokens for c in chunks if c.choices and c.choices[0].logprobs), []) \
            == zlp.tokens


def test_cache_salt_separates_prefix_caches(client):
    long_prompt = PROMPT + " jumps over the lazy dog again and again" * 3
    kw = {"prompt": long_prompt, "max_tokens": 1}
    complete(client, **kw, extra_body={"cache_salt": "a"})
    same = complete(client, **kw, extra_body={"cache_salt": "a"})
    other = complete(client, **kw, extra_body={"cache_salt": "b"})
    assert same.usage.prompt_tokens_details.cached_tokens > 0
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    # (a longer salt separates nothing more: a 10 MB one was kept with its request)
    with pytest.raises(openai.BadRequestError, match="at most 1024 characters") as e:
        complete(client, **kw, extra_body={"cache_salt": "s" * 1025})
    assert e.value.body["param"] == "cache_salt"


def test_continuous_usage_stats(client):
    chunks = list(complete(client, max_tokens=3, stream=True, extra_body={"ignore_eos": True},
                           stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counted = [ch.usage.completion_tokens for ch in chunks if ch.choices]
    assert counted == sorted(counted) and counted[-1] == 3
    # an echo's chunk comes before any generated token, and counts none (it counted the first)
    chunks = list(complete(client, max_tokens=3, stream=True, echo=True, extra_body={"ignore_eos": True},
                           stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert chunks[0].choices[0].text == PROMPT
    counted = [ch.usage.completion_tokens for ch in chunks if ch.choices]
    assert counted[0] == 0 < counted[1] and counted == sorted(counted) and counted[-1] == 3
    # n=2: both echoes come before either choice's text (the second echo counted 0 after the
    # first choice's text had counted both choices' tokens)
    chunks = list(complete(client, max_tokens=3, stream=True, echo=True, n=2, seed=1, temperature=1.0,
                           extra_body={"ignore_eos": True},
                           stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counted = [ch.usage.completion_tokens for ch in chunks if ch.choices]
    assert [ch.choices[0].text for ch in chunks[:2]] == [PROMPT] * 2 and counted[:2] == [0, 0]
    assert counted == sorted(counted) and counted[-1] == 6
    # several prompts: each chunk counts every prompt's tokens (those not answered yet were left out)
    kw = dict(max_tokens=3, stream=True, extra_body={"ignore_eos": True},
              stream_options={"include_usage": True, "continuous_usage_stats": True})
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=["one two", "three four five six"], **kw))
    assert {ch.usage.prompt_tokens for ch in chunks} == {chunks[-1].usage.prompt_tokens}
    # a chat's every chunk carries usage, the role's first (vLLM's: the prompt, 0 generated,
    # and its cached tokens: the second time, the prompt's whole blocks)
    for _ in range(2):
        chunks = list(client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=3, temperature=0, stream=True,
            extra_body={"ignore_eos": True}, stream_options={"include_usage": True, "continuous_usage_stats": True}))
    role, *rest = chunks
    assert role.choices[0].delta.role == "assistant" and role.usage.completion_tokens == 0
    assert all(ch.usage is not None and ch.usage.prompt_tokens == role.usage.prompt_tokens > 0 for ch in rest)
    assert {ch.usage.prompt_tokens_details.cached_tokens for ch in chunks} == {rest[-1].usage.prompt_tokens_details.cached_tokens}
    assert rest[-1].usage.prompt_tokens_details.cached_tokens > 0
    assert [ch.usage.completion_tokens for ch in rest][-1] == 3


def test_tokenize_gives_token_strings_when_asked(server, tokenizer):
    """vLLM's return_token_strs: each id's vocabulary string, as transformers' tokenizer gives it."""
    r = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT, "return_token_strs": True}, headers=AUTH).json()
    assert r["token_strs"] == tokenizer.convert_ids_to_tokens(r["tokens"])
    assert "token_strs" not in httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}, headers=AUTH).json()


def test_an_unknown_models_name_is_cut_short_in_the_404(server):
    r = httpx.post(server.url + CHAT_URL, headers=AUTH, timeout=60,
                   json={"model": "x" * 1_000_000, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404 and len(r.content) < 1000 and "does not exist" in r.json()["error"]["message"]


def test_truncate_prompt_tokens_cuts_text_longer_than_the_context_can_spell(client):
    """vLLM tokenizes, then keeps the last N tokens: text past what max_model_len tokens can
    spell is cut, not refused untokenized as it is without truncate_prompt_tokens; -1
    keeps as many as leave room for max_tokens."""
    long = "the quick brown fox " * 40_000  # 800,000 characters
    with pytest.raises(openai.BadRequestError, match="characters, more than the"):
        complete(client, prompt=long, max_tokens=2)
    r = complete(client, prompt=long, max_tokens=2, extra_body={"truncate_prompt_tokens": 5})
    assert r.usage.prompt_tokens == 5
    r = complete(client, prompt=long, max_tokens=2, extra_body={"truncate_prompt_tokens": -1})
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (254, 2)
    # a chat likewise: rendered (it was refused by the rendered text's characters), then cut
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": long}], "max_tokens": 2}
    with pytest.raises(openai.BadRequestError, match="characters, more than the"):
        client.chat.completions.create(**chat)
    r = client.chat.completions.create(**chat, extra_body={"truncate_prompt_tokens": 7})
    assert r.usage.prompt_tokens == 7

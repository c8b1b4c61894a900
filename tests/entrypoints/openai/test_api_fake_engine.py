"""The HTTP layer in-process (httpx ASGI transport) over the fake engine: states the real
engine cannot be put in on demand (loading, dead), SSE framing and error shapes."""

from __future__ import annotations

import asyncio
import json

import httpx

from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.entrypoints.openai.api_server import Attachment, ServerState, build_app
from tests.engine.fake_engine import FakeEngine


def make_app(engine: FakeEngine | None = None, api_key: str | None = None, ready: bool = True):
    state = ServerState(served_model_names=["fake", "alias"], api_key=api_key)
    app = build_app(state)
    if ready:
        engine = engine or FakeEngine()
        engine.max_model_len = 64
        state.attach(Attachment.local(AsyncLLM(engine, log_stats=False), 64))
    return state, app


def call(app, fn):
    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await fn(client)

    return asyncio.run(asyncio.wait_for(main(), timeout=30))


def events(body: str) -> list:
    out = []
    for block in body.split("\n\n"):
        if block.strip():
            assert block.startswith("data: "), block
            data = block[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_health_503_while_loading_then_200():
    state, app = make_app(ready=False)

    async def fn(c):
        r1 = await c.get("/health")
        r2 = await c.post("/v1/completions", json={"prompt": "x"})
        state.attach(Attachment.local(AsyncLLM(FakeEngine(), log_stats=False), 64))
        r3 = await c.get("/health")
        return r1, r2, r3, await c.head("/health"), await c.head("/ping")

    r1, r2, r3, head, ping = call(app, fn)
    assert head.status_code == ping.status_code == 200  # (load balancers probe with HEAD)
    assert r1.status_code == 503 and r2.status_code == 503
    assert "loading" in r2.json()["error"]["message"]
    assert r3.status_code == 200


def test_dead_engine_error_event_mid_stream_then_503():
    _, app = make_app(FakeEngine(step_time=0.01, fail_after_steps=3))

    async def fn(c):
        r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 50, "stream": True})
        health = await c.get("/health")
        after = await c.post("/v1/completions", json={"prompt": "hi"})
        return r, health, after

    r, health, after = call(app, fn)
    assert r.status_code == 200
    evs = events(r.text)
    assert evs[-1] == "[DONE]"
    assert "error" in evs[-2] and "RuntimeError" in evs[-2]["error"]["message"]
    assert "simulated device failure" not in evs[-2]["error"]["message"]  # details stay in the log
    assert any("choices" in e for e in evs[:-2])  # the stream had started before the failure
    assert health.status_code == 503
    assert after.status_code == 503 and after.json()["error"]["type"] == "server_error"


def test_stream_framing_finish_reason_last_and_usage():
    _, app = make_app(FakeEngine(script="abcdef", step_time=0.002))

    async def fn(c):
        return await c.post("/v1/completions", json={
            "model": "alias", "prompt": ["p1", "p2"], "n": 2, "max_tokens": 6, "stream": True,
            "stream_options": {"include_usage": True}})

    r = call(app, fn)
    assert r.headers["content-type"].startswith("text/event-stream")
    evs = events(r.text)
    assert evs[-1] == "[DONE]"
    usage_chunk = evs[-2]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 24
    assert usage_chunk["usage"]["prompt_tokens"] == 4
    texts: dict[int, str] = {}
    for e in evs[:-2]:
        (choice,) = e["choices"]
        i = choice["index"]
        assert i not in texts or not texts[i].endswith("|"), f"chunk for choice {i} after its finish"
        texts[i] = texts.get(i, "") + choice["text"]
        if choice["finish_reason"] is not None:
            assert choice["finish_reason"] == "length"
            texts[i] += "|"
        assert e["model"] == "alias" and e["id"].startswith("cmpl-")
    # index = prompt_index * n + completion index; the fake cycles the script per child.
    assert texts == {0: "abcdef|", 1: "bcdefa|", 2: "abcdef|", 3: "bcdefa|"}


def test_auth_and_error_shapes():
    _, app = make_app(api_key="sekrit")

    async def fn(c):
        ok_headers = {"Authorization": "Bearer sekrit"}
        return [
            await c.post("/v1/completions", json={"prompt": "x"}),
            await c.post("/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer wrong"}),
            await c.get("/health"),  # not under /v1: no key needed
            await c.post("/v1/completions", json={"prompt": "x", "max_tokens": "many"}, headers=ok_headers),
            await c.post("/v1/completions", json={"prompt": "x", "n": 0}, headers=ok_headers),
            await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                       "logprobs": False, "top_logprobs": 2}, headers=ok_headers),
            await c.post("/v1/completions", json={"prompt": [], "max_tokens": 2}, headers=ok_headers),
            await c.post("/v1/completions", json={"prompt": [999], "max_tokens": 2}, headers=ok_headers),
            await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=ok_headers),
        ]

    rs = call(app, fn)
    codes = [r.status_code for r in rs]
    assert codes == [401, 401, 200, 400, 400, 400, 400, 400, 200]
    for r in rs[:2] + rs[3:8]:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert "max_tokens" in rs[3].json()["error"]["message"]
    assert rs[4].json()["error"]["message"] == "n must be an integer >= 1, got 0"
    assert "top_logprobs requires logprobs" in rs[5].json()["error"]["message"]
    assert "prompt must not be empty" in rs[6].json()["error"]["message"]
    assert "outside the vocabulary" in rs[7].json()["error"]["message"]
    assert [r.json()["error"]["param"] for r in rs[4:8]] == ["n", "top_logprobs", "prompt", "prompt"]


def test_prompt_only_context_error_and_default_max_tokens():
    engine = FakeEngine()
    engine.max_prompt_chars = 100  # (the real engine's: the characters max_model_len could hold)
    _, app = make_app(engine)

    async def fn(c):
        long = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "y" * 80}]})
        fill = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "y" * 20}]})
        by_chars = await c.post("/v1/completions", json={"prompt": "y" * 200})
        return long, fill, by_chars

    long, fill, by_chars = call(app, fn)
    assert long.status_code == by_chars.status_code == 400
    # The engine's refusal in vLLM's words, with the param named as the chat API calls it and
    # OpenAI's code, as where max_tokens is set (clients catch it by either)
    assert long.json()["error"]["message"].startswith("This model's maximum context length is 64 tokens"), long.text
    assert long.json()["error"]["param"] == "messages"
    assert long.json()["error"]["code"] == by_chars.json()["error"]["code"] == "context_length_exceeded", by_chars.text
    # No max_tokens on chat: generate up to the end of the context.
    usage = fill.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 64

    async def scoring(c):  # (min_tokens beside an echo of max_tokens 0: "max_tokens=1", a value never sent)
        return await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 0, "echo": True, "min_tokens": 4})

    r = call(app, scoring)
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens"
    assert "max_tokens 0 scores the prompt" in r.json()["error"]["message"]

    async def over(c):  # (min_tokens over the limit: named as sent, never as the engine's max_tokens)
        chat = {"messages": [{"role": "user", "content": "x"}], "min_tokens": 30, "max_completion_tokens": 20}
        return [await c.post("/v1/chat/completions", json=chat),
                await c.post("/v1/responses", json={"input": "x", "min_tokens": 30, "max_output_tokens": 20})]

    for r in call(app, over):
        assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens", r.text
        assert "max_tokens" not in r.json()["error"]["message"] and "limit of 20" in r.json()["error"]["message"], r.text


def test_an_unknown_models_404_names_the_models_served():
    _, app = make_app()

    async def fn(client):
        return await client.post("/v1/completions", json={"model": "smollm2", "prompt": "x"})

    r = call(app, fn)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert r.json()["error"]["message"] == "The model `smollm2` does not exist; this server serves `fake`, `alias` (GET /v1/models)."


def test_runtime_lora_loading_is_off_unless_the_server_allows_it():
    _, app = make_app()

    async def fn(client):
        return await client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/etc"})

    r = call(app, fn)
    assert r.status_code == 404
    assert "--allow-runtime-lora-updating" in r.json()["error"]["message"]

    async def bad_bodies(client):  # off is off whatever the body (it was a 400 about the body's fields)
        return [await client.post(path, json={}) for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")]

    assert [r.status_code for r in call(app, bad_bodies)] == [404, 404]


def test_a_request_whose_adapter_was_unloaded_meanwhile_is_a_404_not_the_base_model():
    """The adapter a request names is looked up once when its prompts start: one unloaded
    while the request was prepared (tokenizing a long prompt takes seconds) ran the base
    model under the adapter's name."""
    import pytest

    from pagedserve.entrypoints.openai.serving_engine import OpenAIError, OpenAIServing
    from pagedserve.lora.request import LoRARequest

    adapter = LoRARequest("ra", 1, "/adapters/ra")
    serving = OpenAIServing(FakeEngine(), ["base"], 64, lora_modules={"ra": adapter})
    assert serving.lora_request("ra") is adapter
    assert serving.lora_request("base") is None and serving.lora_request(None) is None
    serving.lora_modules.pop("ra")  # (the unload route)
    with pytest.raises(OpenAIError, match="unloaded") as e:
        serving.lora_request("ra")
    assert e.value.status == 404


def test_two_loads_of_one_name_at_once_keep_one_adapter_in_the_engine():
    """The load that loses the race for a name unloads its copy from the engine (it stayed
    in the engine's host cache under an id nothing names); unload checks lora_int_id."""
    import pytest

    from pagedserve.entrypoints.openai.serving_engine import OpenAIError
    from pagedserve.entrypoints.openai.serving_models import LoRAAdapters

    class Engine:
        def __init__(self) -> None:
            self.loaded: set[int] = set()

        async def add_lora(self, request) -> None:
            await asyncio.sleep(0.01)
            self.loaded.add(request.lora_int_id)

        async def remove_lora(self, lora_id: int) -> None:
            self.loaded.discard(lora_id)

    engine, adapters = Engine(), LoRAAdapters(allow_runtime_updating=True)

    async def four_at_once():
        return await asyncio.gather(*(adapters.load(engine, ["base"], "dup", "/adapters/dup") for _ in range(4)),
                                    return_exceptions=True)

    results = asyncio.run(four_at_once())
    assert sum(isinstance(r, str) for r in results) == 1
    assert all(isinstance(r, OpenAIError) for r in results if not isinstance(r, str))
    assert engine.loaded == {adapters.loras["dup"].lora_int_id}
    with pytest.raises(OpenAIError, match="has id"):
        asyncio.run(adapters.unload(engine, "dup", lora_int_id=999))
    asyncio.run(adapters.unload(engine, "dup", lora_int_id=adapters.loras["dup"].lora_int_id))
    assert engine.loaded == set() and "dup" not in adapters.loras


def test_ping_cors_and_a_405s_allow_header():
    """vLLM's /ping (public, as /health), CORS with vLLM's flags (a browser's preflight
    carries no key: answered before the key is asked for), a 405 saying what is allowed."""
    from pagedserve.entrypoints.openai.server_state import CorsOptions

    state, app = make_app(api_key="k")
    state.cors = CorsOptions(["https://app.example"])
    app = build_app(state)

    async def fn(client):
        ping = [await client.get("/ping"), await client.post("/ping")]
        pre = await client.options("/v1/chat/completions", headers={
            "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type"})
        other = await client.options("/v1/chat/completions", headers={
            "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
        wrong = await client.post("/health")
        return ping, pre, other, wrong

    ping, pre, other, wrong = call(app, fn)
    assert [r.status_code for r in ping] == [200, 200]
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "https://app.example"
    assert "access-control-allow-origin" not in other.headers
    assert wrong.status_code == 405 and set(wrong.headers["allow"].split(", ")) == {"GET", "HEAD"}


def test_every_get_route_answers_head_too():
    """RFC 9110: a general-purpose server answers HEAD wherever it answers GET (/v1/models,
    /version, /metrics, /load answered 405); the dashboard's event stream aside, which
    never ends (the dashboard's routes are not in the schema: its page and files checked here)."""
    _, app = make_app()
    paths = app.openapi()["paths"]
    gets = [p for p, ops in paths.items() if "get" in ops]
    assert "/v1/models" in gets and [p for p in gets if "head" not in paths[p]] == []
    heads = call(app, lambda c: asyncio.gather(*(c.head(p) for p in ("/v1/models", "/version", "/v1/models/fake", "/metrics",
                                                                      "/dashboard/static/dashboard.js"))))
    assert [r.status_code for r in heads] == [200] * 5


def test_a_batchs_too_long_prompt_is_refused_before_the_rest_are_tokenized():
    """Each prompt is judged as it is tokenized (the batch was tokenized whole first: 16 MB of
    prompts cost 4-5 s of a core before the first, too long, was refused), with max_tokens
    (the context's rule) and without (the engine's), naming the prompt."""
    engine = FakeEngine()
    _, app = make_app(engine)
    tokenized: list[str] = []
    encode = engine.tokenizer.encode
    engine.tokenizer.encode = lambda text, *args, **kwargs: tokenized.append(text) or encode(text, *args, **kwargs)

    async def fn(c):
        out = []
        for extra in ({"max_tokens": 4}, {"max_tokens": None}):  # (null: the rest of the context)
            tokenized.clear()
            r = await c.post("/v1/completions", json={"prompt": ["ok", "y" * 80, *["z" * 10] * 50], **extra})
            out.append((r, list(tokenized)))
        return out

    for (r, seen), start in zip(call(app, fn), ("This model's maximum context length is 64 tokens. However, you "
                                                "requested 84 tokens (80 in the messages, 4 in the completion)",
                                                "prompt[1]: This model's maximum context length"), strict=True):
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        assert r.json()["error"]["message"].startswith(start), r.text
        assert r.json()["error"]["code"] == "context_length_exceeded", r.text
        assert seen == ["ok", "y" * 80], seen


def test_text_after_a_call_streams_as_the_ordered_apis_answer_it_whole():
    """Responses' output items and Anthropic's content blocks have an order; the answer
    given whole is its text, then its calls.  A model that goes on in text after a call
    must stream the same items (it streamed [text, call, text], and Responses announced a
    second message item under the first one's id)."""
    from pagedserve.entrypoints.openai.tool_parsers import get_tool_parser

    script = 'Hi <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call> Bye'
    state, app = make_app(ready=False)
    engine = FakeEngine(script=script, step_time=0.005)  # (one character a step, read as it comes)
    engine.max_model_len = 512
    state.attach(Attachment.local(AsyncLLM(engine, log_stats=False), 512), tool_parser=get_tool_parser("hermes"))
    tool = {"name": "f", "parameters": {"type": "object"}}
    user = [{"role": "user", "content": "x"}]
    responses = {"input": user, "tools": [{"type": "function", **tool}], "max_output_tokens": len(script)}
    messages = {"messages": user, "max_tokens": len(script),
                "tools": [{"name": "f", "input_schema": {"type": "object"}}]}

    async def fn(c):
        return [await c.post(path, json={**body, "stream": stream}) for path, body in (
            ("/v1/responses", responses), ("/v1/messages", messages)) for stream in (False, True)]

    whole_r, streamed_r, whole_m, streamed_m = call(app, fn)
    assert [i["type"] for i in whole_r.json()["output"]] == ["message", "function_call"]
    assert whole_r.json()["output"][0]["content"][0]["text"] == "Hi\nBye"
    frames = [json.loads(b.split("data: ", 1)[1]) for b in streamed_r.text.split("\n\n") if "data: " in b]
    added = [f["item"] for f in frames if f["type"] == "response.output_item.added"]
    assert [(i["type"], i["id"]) for i in added] == [(i["type"], i["id"]) for i in frames[-1]["response"]["output"]]
    assert [(i["name"], i["arguments"]) for i in frames[-1]["response"]["output"][1:]] == [("f", '{"a": 1}')]
    assert [b["type"] for b in whole_m.json()["content"]] == ["text", "tool_use"]
    blocks: list[dict] = []
    for f in (json.loads(b.split("data: ", 1)[1]) for b in streamed_m.text.split("\n\n") if "data: " in b):
        if f["type"] == "content_block_start":
            blocks.append({**f["content_block"], "partial": ""})
        elif f["type"] == "content_block_delta":
            d = f["delta"]
            key = "text" if "text" in d else "partial"
            blocks[f["index"]][key] += d.get("text", d.get("partial_json", ""))
    assert [(b["type"], b.get("text")) for b in blocks] == [("text", "Hi\nBye"), ("tool_use", None)]
    assert json.loads(blocks[1]["partial"]) == whole_m.json()["content"][1]["input"] == {"a": 1}


def test_a_beam_searchs_steps_keep_its_arrival_time():
    """Each beam-search step is a request of its own; each is given the search's arrival
    time, so that FCFS keeps the search's place in the queue (a step sent at the back
    waited behind every later arrival)."""
    engine = FakeEngine(script="abc")
    _, app = make_app(engine)

    async def fn(c):
        plain = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        beams = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "n": 2,
                                                      "use_beam_search": True, "temperature": 0})
        return plain, beams

    plain, beams = call(app, fn)
    assert plain.status_code == beams.status_code == 200, beams.text
    assert len(beams.json()["choices"]) == 2
    (plain_arrival, *steps) = engine.arrivals.values()
    assert len(steps) >= 3 and len(set(steps)) == 1 and steps[0] > plain_arrival, engine.arrivals

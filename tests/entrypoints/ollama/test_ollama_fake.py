"""Ollama's API in-process (httpx ASGI transport) with the official `ollama` client,
over two fake models in a pool of one loaded model: listing, chat and generate
(streamed or not), load on demand, keep_alive 0, refusals by name, and the OpenAI
routes reaching either model on the same app."""

from __future__ import annotations

import asyncio

import httpx
import ollama
import openai
import pytest

from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.entrypoints.openai.api_server import Attachment, ServerState, build_app
from pagedserve.entrypoints.openai.model_pool import ModelPool, ModelSpec
from pagedserve.entrypoints.openai.responses_store import ResponseStore
from pagedserve.entrypoints.openai.server_state import ModelHandlers
from pagedserve.entrypoints.openai.serving_engine import OpenAIError
from tests.engine.fake_engine import FakeEngine

SCRIPTS = {"first": "hello", "second": "world"}


def make_app(max_loaded: int = 1, dashboard: bool = False, kv_bytes: int | None = None):
    state = ServerState(served_model_names=["first"], enable_dashboard=dashboard)
    state.models = ModelPool([ModelSpec(name, name) for name in SCRIPTS], max_loaded=max_loaded, keep_alive=300.0,
                             estimate=lambda spec: 0)
    loads: list[str] = []

    def attachment(name: str) -> Attachment:
        engine = FakeEngine(script=SCRIPTS[name])
        engine.max_model_len = 64
        return Attachment.local(AsyncLLM(engine, log_stats=False), 64)

    async def load(spec: ModelSpec, kv: int | None) -> ModelHandlers:
        loads.append(spec.name)
        handlers = ModelHandlers.build(made := attachment(spec.name), [spec.name], {})
        handlers.dashboard = state.dashboard_for(made, spec.name, state.new_series())
        return handlers

    state.models.set_loader(load, ModelHandlers.unload, kv_bytes=lambda handlers: kv_bytes)
    app = build_app(state)
    state.attach(attachment("first"))
    return state, app, loads


def call(app, fn):
    async def main():
        transport = httpx.ASGITransport(app=app)
        client = ollama.AsyncClient(host="http://test", transport=transport)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            oai = openai.AsyncOpenAI(base_url="http://test/v1", api_key="none", http_client=http, max_retries=0)
            return await fn(client, oai)
    return asyncio.run(main())


def test_two_models_one_loaded_through_ollamas_client() -> None:
    state, app, loads = make_app()

    async def fn(client: ollama.AsyncClient, oai: openai.AsyncOpenAI):
        listed = [m.model for m in (await client.list()).models]
        assert listed == ["first", "second"]
        assert [m.model for m in (await client.ps()).models] == ["first"]
        r = await client.chat("first", [{"role": "user", "content": "hi"}], options={"num_predict": 5})
        assert r.message.content == "hello" and r.done and r.done_reason == "length" and r.eval_count == 5
        assert r.prompt_eval_count > 0 and r.total_duration >= r.eval_duration >= 0
        parts = [p async for p in await client.chat("second", [{"role": "user", "content": "hi"}],
                                                    options={"num_predict": 5}, stream=True)]
        assert "".join(p.message.content for p in parts) == "world" and parts[-1].done
        assert [p.done for p in parts].count(True) == 1
        assert [m.model for m in (await client.ps()).models] == ["second"]  # first made room
        g = await client.generate("first", "hi", options={"num_predict": 3})
        assert g.response == "hel"
        unloaded = await client.generate("first", keep_alive=0)
        assert unloaded.done_reason == "unload"
        assert (await client.ps()).models == []
        c = await oai.chat.completions.create(model="second", messages=[{"role": "user", "content": "x"}],
                                              max_tokens=2)
        assert c.choices[0].message.content == "wo"
        models = await oai.models.list()
        assert [m.id for m in models.data] == ["first", "second"]
        # raw or not, an empty prompt loads (or with keep_alive 0 unloads), as Ollama's does
        assert (await client.generate("first", raw=True)).done_reason == "load"
        assert (await client.generate("first", raw=True, keep_alive=0)).done_reason == "unload"
        return True

    assert call(app, fn)
    assert loads == ["second", "first", "second", "first"]


def test_ps_size_counts_the_kv_cache() -> None:
    """Ollama's `size` is all a loaded model holds: its KV cache's pages are mapped at load
    and touched as requests use them, so the growth the load measured leaves it out."""
    state, app, _ = make_app(kv_bytes=3 * 2**30)

    async def fn(client: ollama.AsyncClient, oai: openai.AsyncOpenAI):
        await client.generate("second", "hi", options={"num_predict": 1})
        return (await client.ps()).models

    (model,) = call(app, fn)
    assert model.model == "second" and 3 * 2**30 <= model.size < 4 * 2**30


def test_refusals_name_what_is_not_served() -> None:
    _, app, _ = make_app()

    async def fn(client: ollama.AsyncClient, oai: openai.AsyncOpenAI):
        errors = {}
        for name, coro in {
            "missing": client.chat("/etc/passwd", [{"role": "user", "content": "x"}]),
            "pull": client.pull("llama3"),
            "think": client.chat("first", [{"role": "user", "content": "x"}], think=True),
            "suffix": client.generate("first", "x", suffix="y"),
            "option": client.generate("first", "x", options={"mirostat": 2}),
            "images": client.generate("first", "x", images=[b"\x89PNG"]),
            "embed": client.embed("first", "x"),
            "keep_alive": client.generate("first", "x", keep_alive="soon"),
            "num_predict": client.generate("first", "x", options={"num_predict": 0}),
        }.items():
            with pytest.raises(ollama.ResponseError) as e:
                await coro
            errors[name] = (e.value.status_code, e.value.error)
        return errors

    errors = call(app, fn)
    assert errors["missing"][0] == 404 and "/etc/passwd" in errors["missing"][1]
    assert errors["pull"][0] == 501 and "--models-dir" in errors["pull"][1]
    assert errors["think"][0] == 400 and "think" in errors["think"][1]
    assert errors["suffix"][0] == 400 and "suffix" in errors["suffix"][1]
    assert errors["option"][0] == 400 and "mirostat" in errors["option"][1]
    assert errors["images"][0] == 400 and "images" in errors["images"][1]
    assert errors["embed"][0] == 400 and "pooling" in errors["embed"][1]
    assert errors["keep_alive"][0] == 400 and "keep_alive" in errors["keep_alive"][1]
    assert errors["num_predict"][0] == 400 and "num_predict" in errors["num_predict"][1]


def test_an_empty_chat_or_prompt_is_checked_and_errors_speak_ollamas_names() -> None:
    """A chat without messages or a generate without a prompt (a load) still has its fields
    checked (every bad one answered 200); ranges the engine checks are named as the
    client sent them (options.top_p, not top_p); an unknown model in Ollama's words;
    roles checked; Ollama's image-generation fields refused; stream null is the default."""
    _, app, _ = make_app()

    async def fn(client: ollama.AsyncClient, oai: openai.AsyncOpenAI):
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
        out = []
        for path, body in [
            ("/api/generate", {"model": "first", "options": {"temperature": "hot"}}),
            ("/api/generate", {"model": "first", "format": "yaml"}),
            ("/api/generate", {"model": "first", "suffix": "x"}),
            ("/api/chat", {"model": "first", "options": {"bogus": 1}}),
            ("/api/chat", {"model": "first", "messages": [{"role": "user", "content": "x"}],
                           "options": {"top_p": 0}}),
            ("/api/generate", {"model": "first", "prompt": "x", "options": {"repeat_penalty": 0}}),
            ("/api/chat", {"model": "first", "messages": [{"role": "bogus", "content": "x"}]}),
            ("/api/chat", {"model": "first", "format": 5}),
            ("/api/generate", {"model": "first", "prompt": "x", "width": 512}),
            ("/api/generate", {"model": "first", "prompt": "x", "num_predict": 1}),  # (an option beside options)
            ("/api/chat", {"model": "first", "messages": [{"role": "user", "content": ["hi"]}]}),
            # A message's unknown key (a misspelled content was an empty turn), and OpenAI's
            # keys checked as OpenAI's route checks them.
            ("/api/chat", {"model": "first", "messages": [{"role": "user", "contents": "x"}]}),
            ("/api/chat", {"model": "first", "messages": [{"role": "user", "content": "x", "tool_call_id": "1"}]}),
            ("/api/chat", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}),
            ("/api/chat", {"model": "first", "messages": [{"role": "user", "content": "x"}], "stream": None}),
        ]:
            r = await http.post(path, json=body)
            out.append((r.status_code, r.json().get("error") if r.status_code != 200 else None))
        await http.aclose()
        return out

    got = call(app, fn)
    assert [status for status, _ in got] == [400] * 13 + [404, 200], got
    errors = [e for _, e in got]
    assert "options.temperature" in errors[0] and "format" in errors[1] and "suffix" in errors[2]
    assert "options.bogus" in errors[3]
    assert errors[4].startswith("options.top_p ") and errors[5].startswith("options.repeat_penalty "), errors
    assert "messages[0].role" in errors[6] and "JSON schema" in errors[7] and "width" in errors[8]
    assert errors[9].startswith("num_predict is an option: send it in options")
    assert errors[10] == "messages[0].content must be a string"  # (was pydantic's "messages.0.content.str: ...")
    assert errors[11] == "messages[0]: 'contents' is not a field of a message", errors[11]
    assert "'tool_call_id' is not a field of a user message" in errors[12], errors[12]
    assert errors[13] == "model 'nope' not found"


def test_a_bad_request_for_a_model_not_loaded_loads_nothing() -> None:
    """Its options are checked before the model is leased (as Ollama parses them before
    scheduling): it unloaded the loaded model, loaded its own and took its keep_alive,
    then answered 400."""
    state, app, loads = make_app()

    async def fn(client: ollama.AsyncClient, oai: openai.AsyncOpenAI):
        for coro in (client.generate("second", "x", options={"temperature": -1}, keep_alive=-1),
                     client.chat("second", [{"role": "user", "content": "x"}], options={"top_p": 5})):
            with pytest.raises(ollama.ResponseError) as e:
                await coro
            assert e.value.status_code == 400

    call(app, fn)
    assert loads == [] and state.models.handlers("first") is not None


def test_an_openai_request_out_of_range_for_a_model_not_loaded_loads_nothing() -> None:
    """max_tokens 0 on /v1/completions (and chat's temperature -1) loaded the model, and
    unloaded the other, before the 400."""
    state, app, loads = make_app()

    async def fn(client: ollama.AsyncClient, oai: openai.AsyncOpenAI):
        with pytest.raises(openai.BadRequestError, match="max_tokens"):
            await oai.completions.create(model="second", prompt="x", max_tokens=0)
        with pytest.raises(openai.BadRequestError, match="temperature"):
            await oai.chat.completions.create(model="second", messages=[{"role": "user", "content": "x"}],
                                              temperature=-1)

    call(app, fn)
    assert loads == [] and state.models.handlers("first") is not None


def test_every_check_that_needs_no_model_comes_before_its_load(tmp_path) -> None:
    """num_predict 0, num_ctx 0, think on a server without a reasoning parser, system for
    a base model (one whose files hold no chat template): each a 400 before the load
    (each loaded its model and unloaded the other first), with a prompt or without one
    (a load-only request answered 200 to what the same request with a prompt refused)."""
    import json

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    state, app, loads = make_app()
    state.splits_reasoning = False  # (as `pagedserve serve` sets it from --reasoning-parser)
    state.models = ModelPool([ModelSpec("first", "first"), ModelSpec("base", str(tmp_path))], max_loaded=1,
                             keep_alive=300.0, estimate=lambda spec: 0)
    state.models.set_loader(lambda spec, kv: pytest.fail(f"{spec.name} was loaded"), ModelHandlers.unload)
    state.attach(Attachment.local(AsyncLLM(FakeEngine(script="hello"), log_stats=False), 64))

    async def fn(client: ollama.AsyncClient, oai: openai.AsyncOpenAI):
        refused = []
        for prompt in ("x", ""):
            for kw, name in (({"options": {"num_predict": 0}}, "num_predict"), ({"options": {"num_ctx": 0}}, "num_ctx"),
                             ({"think": True}, "think"), ({"system": "be brief"}, "system")):
                with pytest.raises(ollama.ResponseError, match=name) as e:
                    await client.generate("base", prompt, **kw)
                refused.append(e.value.status_code)
            with pytest.raises(ollama.ResponseError, match="think"):
                await client.chat("base", [{"role": "user", "content": "x"}] if prompt else [], think=True)
        return refused

    assert call(app, fn) == [400] * 8 and loads == []


def test_repeat_last_n_0_turns_the_models_repeat_penalty_off_and_a_window_is_refused_beside_it() -> None:
    """Ollama's repeat_last_n: 0 is no repeat penalty, -1 the whole context (this
    server's); another window beside a penalty the model's generation config sets is
    refused by name (it was dropped: the penalty ran over the whole context)."""
    from pagedserve.entrypoints.ollama.protocol import OllamaGenerateRequest
    from pagedserve.entrypoints.ollama.serving import OllamaServing, Timing

    state, app, _ = make_app()
    handlers = state.models.handlers("first")
    handlers.engine.sampling_defaults = {"repetition_penalty": 1.3}  # (the model's generation config)
    serving = OllamaServing(handlers.chat, handlers.completion, Timing())

    def penalty(**options):
        req = OllamaGenerateRequest(model="first", prompt="x", options=options)
        return serving.prepare(req).prepared.params.repetition_penalty

    assert penalty() == 1.3 and penalty(repeat_last_n=-1) == 1.3 and penalty(repeat_last_n=0) == 1.0
    with pytest.raises(OpenAIError, match="repeat_last_n"):
        penalty(repeat_last_n=64)
    handlers.engine.sampling_defaults = {}
    with pytest.raises(OpenAIError, match="repeat_last_n"):  # (Ollama windows these too: it was accepted)
        penalty(repeat_last_n=64, presence_penalty=0.5)
    assert penalty(repeat_last_n=64) == 1.0  # (no penalty in effect: nothing to shape)
    # num_keep is the prompt tokens a context shift keeps (llama.cpp's n_keep), no penalty's
    # window: accepted beside one, as `shift` (it was refused beside the model's penalty)
    handlers.engine.sampling_defaults = {"repetition_penalty": 1.3}
    assert penalty(num_keep=4) == 1.3 and penalty(num_keep=4, repeat_penalty=1.1) == 1.1


def test_a_route_of_the_other_runner_loads_no_model_to_refuse() -> None:
    state, app, loads = make_app()
    state.runner = "generate"  # as `pagedserve serve` sets it from --runner

    async def fn(client: ollama.AsyncClient, oai: openai.AsyncOpenAI):
        for coro in (client.embed("second", "x"), client.embed("second", [])):
            with pytest.raises(ollama.ResponseError) as e:
                await coro
            assert e.value.status_code == 400 and "--runner pooling" in e.value.error

    call(app, fn)
    assert loads == []  # "second" was never loaded (and "first" stays the one loaded)


def test_show_names_the_servers_runner_for_a_model_not_loaded(tmp_path) -> None:
    """Under --runner pooling a model not loaded yet shows `embedding` (it showed
    `completion`, then `embedding` once loaded)."""
    import json

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    state, app, _ = make_app()
    state.models = ModelPool([ModelSpec("first", "first"), ModelSpec("other", str(tmp_path))], estimate=lambda s: 0)
    state.attach(Attachment.local(AsyncLLM(FakeEngine(script="hello"), log_stats=False), 64))

    async def fn(client: ollama.AsyncClient, oai: openai.AsyncOpenAI):
        shown = []
        for runner in ("pooling", "generate"):
            state.runner = runner  # (as `pagedserve serve` sets it from --runner)
            shown.append((await client.show("other")).capabilities)
        return shown

    assert call(app, fn) == [["embedding"], ["completion"]]


def test_show_and_version() -> None:
    _, app, _ = make_app()

    async def fn(client: ollama.AsyncClient, oai: openai.AsyncOpenAI):
        shown = await client.show("second")
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            version = (await http.get("/api/version")).json()
        return shown, version

    shown, version = call(app, fn)
    # (its source names no files: nothing is known of it but its name; an "unknown"
    # architecture of 0 parameters and a "completion" capability were invented)
    assert not shown.template and shown.capabilities == [] and shown.modelinfo == {}
    assert version["version"]


def test_tools_come_back_as_ollamas_tool_calls_streamed_or_not() -> None:
    from pagedserve.entrypoints.openai.tool_parsers import get_tool_parser

    call_text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    state = ServerState(served_model_names=["fake"], enable_dashboard=False)
    app = build_app(state)
    engine = FakeEngine(script=call_text)
    engine.max_model_len = 2048  # (the tools' system block is long in characters, its tokens here)
    state.attach(Attachment.local(AsyncLLM(engine, log_stats=False), 2048), get_tool_parser("hermes"))
    tool = {"type": "function", "function": {"name": "get_weather", "description": "weather",
                                             "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                            "required": ["city"]}}}
    history = [{"role": "user", "content": "weather in Paris?"},
               {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather",
                                                                                 "arguments": {"city": "Rome"}}}]},
               {"role": "tool", "content": "sunny", "tool_name": "get_weather"},
               {"role": "user", "content": "and Paris?"}]

    async def fn(client: ollama.AsyncClient, oai: openai.AsyncOpenAI):
        whole = await client.chat("fake", history, tools=[tool], options={"num_predict": len(call_text)})
        parts = [p async for p in await client.chat("fake", history, tools=[tool], stream=True,
                                                    options={"num_predict": len(call_text)})]
        return whole, parts

    whole, parts = call(app, fn)
    (tc,) = whole.message.tool_calls
    assert tc.function.name == "get_weather" and tc.function.arguments == {"city": "Paris"}
    streamed = [c for p in parts for c in p.message.tool_calls or []]
    assert [(c.function.name, c.function.arguments) for c in streamed] == [("get_weather", {"city": "Paris"})]
    # As Ollama streams them: on a line of their own before the done line
    assert parts[-2].message.tool_calls and not parts[-2].done
    assert parts[-1].done and not parts[-1].message.tool_calls and parts[-1].message.content == ""



def test_each_loaded_model_has_its_dashboard_and_watching_loads_none() -> None:
    from pagedserve.entrypoints.openai.server_state import dashboard_hub
    from pagedserve.entrypoints.openai.serving_engine import OpenAIError

    state, app, loads = make_app(dashboard=True)

    async def fn(client: ollama.AsyncClient, oai: openai.AsyncOpenAI):
        first = await dashboard_hub(state)
        assert first.config["served_model_name"] == "first"
        with pytest.raises(OpenAIError, match="'second' is not loaded") as e:
            await dashboard_hub(state, "second")
        assert e.value.status == 503 and loads == []  # looking loads nothing
        page: asyncio.Queue = asyncio.Queue()  # an open page's queue (the fake engine takes no snapshots)
        first.subscribers.add(page)
        await client.generate("second", "hi", options={"num_predict": 2})  # first makes room: its pages end
        assert page.get_nowait() is None and not first.subscribers
        second = await dashboard_hub(state)  # the most recently used loaded model's
        assert second.config["served_model_name"] == "second" and second is await dashboard_hub(state, "second")
        return True

    assert call(app, fn)


def test_ollamas_own_conventions() -> None:
    """What Ollama's clients send as a matter of course: `NAME:latest`, num_predict past
    the context (stops where it is full), seed -1 (random), whole-number floats for
    integer options, mirostat's tau and eta at their defaults, options on embeddings
    (LangChain sends every option, most null), HEAD to see that the server is up."""
    from pagedserve.entrypoints.ollama.protocol import OllamaEmbedRequest, OllamaGenerateRequest

    _, app, _ = make_app(dashboard=True)

    async def fn(client: ollama.AsyncClient, oai: openai.AsyncOpenAI):
        g = await client.generate("first:latest", "hi", options={
            "num_predict": 100000, "seed": -1, "num_ctx": 48.0, "mirostat_tau": 5.0, "mirostat_eta": 0.1})
        assert g.done and g.response.startswith("hello") and g.eval_count + g.prompt_eval_count <= 48
        shown = await client.show("first:latest")
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            heads = [(await http.head(path)).status_code for path in ("/", "/api/version", "/api/tags")]
            bad = {}
            for name, body in {
                "tool_call_string": {"messages": [{"role": "assistant", "content": "", "tool_calls": [
                    {"function": "get_weather"}]}, {"role": "user", "content": "x"}]},
                "tool_call_number": {"messages": [{"role": "assistant", "content": "", "tool_calls": [1]}]},
                "arguments_list": {"messages": [{"role": "assistant", "content": "", "tool_calls": [
                    {"function": {"name": "f", "arguments": [1]}}]}]},
                "keep_alive_bool": {"messages": [{"role": "user", "content": "x"}], "keep_alive": True},
                "temperature_word": {"messages": [{"role": "user", "content": "x"}], "options": {"temperature": "hot"}},
                "stream_word": {"messages": [{"role": "user", "content": "x"}], "stream": "yes"},  # (was true)
            }.items():
                r = await http.post("/api/chat", json={"model": "first", "stream": False, **body})
                bad[name] = (r.status_code, r.json()["error"])
            healthy = (await http.post("/api/chat", json={"model": "first", "stream": False, "messages": [
                {"role": "user", "content": "x"}]})).status_code
        return shown, heads, bad, healthy

    shown, heads, bad, healthy = call(app, fn)
    assert shown.details is not None and heads == [200, 200, 200] and healthy == 200

    async def without_dashboard(client: ollama.AsyncClient, oai: openai.AsyncOpenAI):
        transport = httpx.ASGITransport(app=bare)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            return (await http.head("/")).status_code, (await http.get("/")).text

    _, bare, _ = make_app(dashboard=False)
    assert call(bare, without_dashboard) == (200, "pagedserve is running")
    assert all(status == 400 for status, _ in bad.values()), bad
    assert "messages[0].tool_calls[0]" in bad["tool_call_string"][1] and "tool_calls[0]" in bad["tool_call_number"][1]
    assert "arguments must be an object" in bad["arguments_list"][1]
    assert "keep_alive" in bad["keep_alive_bool"][1] and "stream" in bad["stream_word"][1]
    assert bad["temperature_word"][1].startswith("options.temperature:") and "pydantic" not in bad["temperature_word"][1]
    # Ollama's -1 is a random seed, as with none; 7.0 is 7; an option Ollama does not define is named.
    from pagedserve import SamplingParams

    sampling = OllamaGenerateRequest(model="m", prompt="x", options={"seed": -1, "top_k": 3.0}).sampling()
    assert SamplingParams(seed=sampling["seed"]).seed is None and sampling["top_k"] == 3
    assert OllamaGenerateRequest(model="m", prompt="x", options={"seed": 7.0}).sampling()["seed"] == 7
    OllamaEmbedRequest(model="m", input="x", options={"num_ctx": None, "temperature": 0.8, "num_thread": 2}).check_options()
    with pytest.raises(Exception, match="options.bogus"):
        OllamaEmbedRequest(model="m", input="x", options={"bogus": 1}).check_options()
    # Of Ollama's types on every route, embeddings too (temperature "x" and num_gpu "x" were taken there)
    for options, why in (({"temperature": "x"}, "a number"), ({"num_gpu": "x"}, "a number"),
                         ({"num_thread": 2.5}, "an integer"), ({"use_mmap": 1}, "true or false"),
                         ({"stop": [1]}, "a list of strings"), ({"seed": True}, "a number")):
        with pytest.raises(Exception, match=f"options.{next(iter(options))}: must be {why}"):
            OllamaEmbedRequest(model="m", input="x", options=options).check_options()
    OllamaEmbedRequest(model="m", input="x", options={"stop": "\n", "use_mmap": False, "num_gpu": 99.0,
                                                      "top_p": 1}).check_options()
    assert OllamaEmbedRequest(model="m:latest", input=[]).empty() and OllamaEmbedRequest(model="m").model == "m"


def test_think_returns_the_reasoning_apart_with_a_reasoning_parser() -> None:
    """With --reasoning-parser, Ollama's `think` is served (it was refused whatever the
    server): the reasoning comes as message.thinking (a `thinking` line while streaming),
    the answer as content; think false leaves it out.  A completion of a raw prompt
    splits nothing, and says so."""
    from pagedserve.entrypoints.openai.reasoning_parsers import REASONING_PARSERS

    state = ServerState(served_model_names=["thinker"])
    app = build_app(state)
    engine = FakeEngine(script="<think>hmm</think>Paris")
    engine.max_model_len = 64
    state.attach(Attachment.local(AsyncLLM(engine, log_stats=False), 64), None, REASONING_PARSERS["qwen3"])
    messages = [{"role": "user", "content": "capital?"}]
    options = {"num_predict": len("<think>hmm</think>Paris")}

    async def fn(client: ollama.AsyncClient, oai: openai.AsyncOpenAI):
        full = await client.chat("thinker", messages, think=True, options=options)
        streamed = [part async for part in await client.chat("thinker", messages, think=True, options=options,
                                                               stream=True)]
        quiet = await client.chat("thinker", messages, think=False, options=options)
        generated = await client.generate("thinker", "capital?", think=True, options=options)
        with pytest.raises(ollama.ResponseError) as raw:
            await client.generate("thinker", "capital?", raw=True, think=True)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            bad = [(await http.post("/api/chat", json={"model": "thinker", "messages": messages, "think": value,
                                                      "stream": False, "options": options})).status_code
                   for value in ("false", "extreme", 1)]
        return full, streamed, quiet, generated, raw.value, bad

    full, streamed, quiet, generated, raw, bad = call(app, fn)
    assert (full.message.thinking, full.message.content) == ("hmm", "Paris")
    assert "".join(p.message.thinking or "" for p in streamed) == "hmm"
    assert "".join(p.message.content or "" for p in streamed) == "Paris"
    assert quiet.message.thinking is None and quiet.message.content == "Paris"
    assert (generated.thinking, generated.response) == ("hmm", "Paris")
    assert raw.status_code == 400 and "think" in raw.error
    assert bad == [400] * 3  # ("false" thought, as true did)
    # an answer's thinking sent back reaches the template, as Ollama's does
    from pagedserve.entrypoints.ollama.protocol import OllamaChatRequest
    from pagedserve.entrypoints.ollama.serving import chat_request

    history = OllamaChatRequest(model="thinker", messages=[
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "thinking": "because"},
        {"role": "user", "content": "again"}])
    assert chat_request(history).messages[1].model_dump()["reasoning_content"] == "because"


def test_a_chat_for_a_model_without_a_chat_template_unloads_nothing(tmp_path) -> None:
    """Refused before its load: the loaded model was unloaded for it, then loaded again
    by the next request (Anthropic's, Ollama's and the Responses API's chats too)."""
    import json

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    state, app, loads = make_app()
    state.models = ModelPool([ModelSpec("first", "first"), ModelSpec("base", str(tmp_path))], max_loaded=1,
                             keep_alive=300.0, estimate=lambda spec: 0)
    state.models.set_loader(lambda spec, kv: pytest.fail(f"{spec.name} was loaded"), ModelHandlers.unload)
    state.attach(Attachment.local(AsyncLLM(FakeEngine(script="hello"), log_stats=False), 64))

    async def fn(client: ollama.AsyncClient, oai: openai.AsyncOpenAI):
        with pytest.raises(openai.BadRequestError, match="'base': this model has no chat template"):
            await oai.chat.completions.create(model="base", messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(openai.BadRequestError, match="no chat template") as e:
            await oai.responses.create(model="base", input="hi")
        assert e.value.body["param"] == "input"  # (the Responses API's field: it said "messages")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            r = await http.post("/v1/messages", json={"model": "base", "max_tokens": 4,
                                                      "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and "no chat template" in r.json()["error"]["message"]
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            r = await http.post("/tokenize", json={"model": "base", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and "no chat template" in r.json()["error"]["message"]
        with pytest.raises(ollama.ResponseError, match="no chat template to put messages in: /api/generate") as e:
            await client.chat(model="base", messages=[{"role": "user", "content": "hi"}])
        assert e.value.status_code == 400
        return await oai.completions.create(model="first", prompt="x", max_tokens=2)

    assert call(app, fn).choices[0].text == "he"


@pytest.mark.parametrize(("path", "fields"), [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2}), ("/tokenize", {"prompt": "hi"}),
    ("/detokenize", {"tokens": [1, 2]}), ("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/api/generate", {}), ("/api/chat", {}),  # (Ollama's preload: no prompt, no messages)
])
def test_a_client_that_leaves_while_its_model_waits_for_room_loads_nothing(path: str, fields: dict) -> None:
    """The lease was taken before the disconnect watch began: the load went on waiting
    for room, then unloaded the busy model and loaded one nobody wanted (for its whole
    keep_alive); /tokenize, /detokenize, count_tokens and Ollama's preload had no watch."""
    import json

    state, app, loads = make_app()

    async def main():
        busy = await state.models.lease("first")
        body = json.dumps({"model": "second", **fields}).encode()
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
                 "root_path": "", "client": ("127.0.0.1", 1), "server": ("test", 80),
                 "headers": [(b"host", b"test"), (b"content-type", b"application/json"),
                             (b"content-length", str(len(body)).encode())]}
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict:
            if messages:
                return messages.pop()
            await asyncio.sleep(0.1)  # the client hangs up while "second" waits for "first" to go idle
            return {"type": "http.disconnect"}

        sent: list[dict] = []

        async def send(message: dict) -> None:
            sent.append(message)

        await asyncio.wait_for(app(scope, receive, send), 5)
        busy.release()
        await asyncio.sleep(0.2)
        return sent

    sent = asyncio.run(main())
    assert loads == [] and state.models.handlers("first") is not None and state.models.handlers("second") is None
    assert sent[0]["status"] == 499


def test_v1_models_shows_the_max_model_len_of_a_model_not_loaded_yet() -> None:
    """vLLM's field, which clients size their context by: a model not loaded showed null;
    its config and the server's flags give it (read once, and not at all for one whose
    config cannot be read)."""
    state, app, loads = make_app()
    looked: list[str] = []

    def check(spec: ModelSpec) -> int | None:
        looked.append(spec.name)
        if spec.name == "broken":
            raise ValueError("unreadable")
        return 4096

    state.models = ModelPool([ModelSpec("first", "first"), ModelSpec("second", "second"),
                              ModelSpec("broken", "broken")], keep_alive=300.0, estimate=lambda spec: 0, check=check)
    state.models.set_loader(lambda spec, kv: pytest.fail(f"{spec.name} was loaded"), ModelHandlers.unload)
    state.attach(Attachment.local(AsyncLLM(FakeEngine(script="hello"), log_stats=False), 64))

    async def fn(client: ollama.AsyncClient, oai: openai.AsyncOpenAI):
        listed = {m.id: m.model_extra["max_model_len"] for m in (await oai.models.list()).data}
        again = await oai.models.retrieve("second")
        return listed, again.model_extra["max_model_len"]

    listed, again = call(app, fn)
    assert listed == {"first": 64, "second": 4096, "broken": None} and again == 4096
    assert sorted(looked) == ["broken", "second"] and loads == []


def test_cache_salt_reaches_the_chat_and_completion_requests() -> None:
    """vLLM's cache_salt (not Ollama's) was logged as unknown, and the cache shared."""
    from pagedserve.entrypoints.ollama.protocol import OllamaChatRequest, OllamaGenerateRequest
    from pagedserve.entrypoints.ollama.serving import chat_request, generate_request

    chat = OllamaChatRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                             "cache_salt": "tenant"})
    assert chat_request(chat).cache_salt == "tenant"
    raw = OllamaGenerateRequest.model_validate({"model": "m", "prompt": "x", "raw": True, "cache_salt": "tenant"})
    assert generate_request(raw, has_template=True).cache_salt == "tenant"
    assert generate_request(raw.model_copy(update={"raw": False}), has_template=True).cache_salt == "tenant"
    with pytest.raises(ValueError, match="cache_salt"):
        OllamaChatRequest.model_validate({"model": "m", "messages": [], "cache_salt": ["x"]})


def test_show_lists_thinking_where_think_is_served_and_a_null_chat_is_a_load(tmp_path) -> None:
    """Ollama's clients send `think` only to a model whose capabilities list "thinking",
    which never appeared; and Go reads "messages": null as no messages (a load request),
    where it was a 400."""
    import json

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    state, app, _ = make_app()
    state.models = ModelPool([ModelSpec("first", "first"), ModelSpec("other", str(tmp_path))], estimate=lambda s: 0)
    state.attach(Attachment.local(AsyncLLM(FakeEngine(script="hello"), log_stats=False), 64))

    async def fn(client: ollama.AsyncClient, oai: openai.AsyncOpenAI):
        shown = []
        for splits in (True, False):
            state.splits_reasoning = splits  # (as `pagedserve serve` sets it from --reasoning-parser)
            shown.append((await client.show("other")).capabilities)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            loaded = (await http.post("/api/chat", json={"model": "first", "messages": None, "stream": False})).json()
        return shown, loaded

    shown, loaded = call(app, fn)
    assert shown == [["completion", "tools", "thinking"], ["completion", "tools"]]
    assert loaded["done_reason"] == "load", loaded


def test_tags_lists_every_served_name_as_v1_models_does() -> None:
    """--served-model-name's aliases answered on Ollama's routes but were missing from
    /api/tags (one listing per model, not per name)."""
    state = ServerState(served_model_names=["smol", "smol2"], enable_dashboard=False)
    engine = FakeEngine(script="hi")
    engine.max_model_len = 64
    app = build_app(state)
    state.attach(Attachment.local(AsyncLLM(engine, log_stats=False), 64))

    async def fn(client: ollama.AsyncClient, oai: openai.AsyncOpenAI):
        return [m.model for m in (await client.list()).models], [m.id async for m in oai.models.list()]

    tags, models = call(app, fn)
    assert tags == models == ["smol", "smol2"]


def test_an_image_for_a_text_model_not_loaded_is_refused_before_its_load(tmp_path) -> None:
    """A text model's files say it takes no images: each API's image (OpenAI's image_url,
    the Responses API's input_image, Anthropic's image block and one in a tool_result,
    Ollama's images) is a 400 naming the model and the field before its load (the loaded
    model was unloaded for it, then the text model loaded only to refuse it); a model
    whose files name a vision-language architecture is let through to its load."""
    import asyncio
    import json

    png = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAAAAAA6fptVAAAACklEQVR4nGP4DwABAQEAJpx8iQAAAABJRU5ErkJggg=="
    text_dir, vision_dir = tmp_path / "text", tmp_path / "vision"
    for path, arch in ((text_dir, "LlamaForCausalLM"), (vision_dir, "Idefics3ForConditionalGeneration")):
        path.mkdir()
        (path / "config.json").write_text(json.dumps({"architectures": [arch], "model_type": "llama"}))
        (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    state, app, loads = make_app()
    state.models = ModelPool([ModelSpec("first", "first"), ModelSpec("text", str(text_dir)),
                              ModelSpec("vision", str(vision_dir))], max_loaded=1, keep_alive=300.0,
                             estimate=lambda spec: 0)
    state.models.set_loader(lambda spec, kv: pytest.fail(f"{spec.name} was loaded"), ModelHandlers.unload)
    state.attach(Attachment.local(AsyncLLM(FakeEngine(script="hello"), log_stats=False), 64))
    url = f"data:image/png;base64,{png}"
    image_block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}}

    async def fn(client: ollama.AsyncClient, oai: openai.AsyncOpenAI):
        params = []
        with pytest.raises(openai.BadRequestError, match="model 'text' takes no images") as e:
            await oai.chat.completions.create(model="text", messages=[{"role": "user", "content": [
                {"type": "text", "text": "what is it?"}, {"type": "image_url", "image_url": {"url": url}}]}])
        params.append(e.value.body["param"])
        with pytest.raises(openai.BadRequestError, match="model 'text' takes no images") as e:
            await oai.responses.create(model="text", input=[{"role": "user", "content": [
                {"type": "input_image", "image_url": url}]}])
        params.append(e.value.body["param"])
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            for path, extra in (("/v1/messages", {"max_tokens": 4}), ("/v1/messages/count_tokens", {})):
                for content in ([image_block], [{"type": "tool_result", "tool_use_id": "t", "content": [image_block]}]):
                    r = await http.post(path, json={"model": "text", "messages": [{"role": "user", "content": content}],
                                                    **extra})
                    assert r.status_code == 400 and "model 'text' takes no images" in r.json()["error"]["message"]
            r = await http.post("/tokenize", json={"model": "text", "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": url}}]}]})
            assert r.status_code == 400 and "model 'text' takes no images" in r.json()["error"]["message"]
        with pytest.raises(ollama.ResponseError, match="model 'text' takes no images") as e:
            await client.chat(model="text", messages=[{"role": "user", "content": "hi", "images": [png]}])
        with pytest.raises(ollama.ResponseError, match="model 'text' takes no images") as e:
            await client.generate(model="text", prompt="hi", images=[png])
        return params, await oai.completions.create(model="first", prompt="x", max_tokens=2)

    state.responses_store = ResponseStore()
    for response_id, content in (("resp_image", [{"type": "image_url", "image_url": {"url": url}}]),
                                 ("resp_text", "hello")):
        state.responses_store.put({"id": response_id}, [{"role": "user", "content": content}])

    async def continued(client: ollama.AsyncClient, oai: openai.AsyncOpenAI):
        # an image in the conversation a response continues, as one in its own input
        with pytest.raises(openai.BadRequestError, match="model 'text' takes no images") as e:
            await oai.responses.create(model="text", input="and now?", previous_response_id="resp_image")
        with pytest.raises(openai.APIError):  # a text model is loaded for a text history
            await oai.responses.create(model="text", input="and now?", previous_response_id="resp_text")
        return e.value.body["param"]

    params, answer = call(app, fn)
    assert params == ["messages", "input"] and answer.choices[0].text == "he" and loads == []
    assert asyncio.run(state.takes_images("vision")) and not asyncio.run(state.takes_images("text"))
    tried: list[str] = []
    state.models.set_loader(lambda spec, kv: tried.append(spec.name) or 1 / 0, ModelHandlers.unload)
    assert call(app, continued) == "previous_response_id" and tried == ["text"]

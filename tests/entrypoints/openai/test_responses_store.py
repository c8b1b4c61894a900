"""--enable-responses-store: GET /v1/responses/{id}, previous_response_id, store: false,
and the store's bounds (in-process app over the scripted engine, the official client)."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.entrypoints.openai.api_server import Attachment, ServerState, build_app
from pagedserve.entrypoints.openai.responses_store import ResponseStore
from tests.engine.fake_engine import FakeEngine


def run_with_client(fn, store: ResponseStore | None):
    state = ServerState(served_model_names=["fake"], responses_store=store)
    app = build_app(state)
    engine = FakeEngine(script="abcdefghij")
    engine.max_model_len = 4096
    state.attach(Attachment.local(AsyncLLM(engine, log_stats=False), 4096))

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="none", http_client=http, max_retries=0)
            return await fn(client)

    return asyncio.run(asyncio.wait_for(main(), timeout=30))


def test_stored_responses_are_retrieved_and_continued() -> None:
    async def fn(client: openai.AsyncOpenAI):
        first = await client.responses.create(model="fake", input="hello", instructions="be brief",
                                              max_output_tokens=5)
        got = await client.responses.retrieve(first.id)
        assert got.id == first.id and got.output_text == first.output_text == "abcde" and got.store
        follow = await client.responses.create(model="fake", input="and then?", previous_response_id=first.id,
                                               max_output_tokens=3)
        alone = await client.responses.create(model="fake", input="and then?", max_output_tokens=3, store=False)
        # The continuation's prompt holds the first turn and its answer (the scripted engine's
        # tokens are characters); its instructions are not carried over, as in OpenAI's API.
        assert follow.usage.input_tokens >= alone.usage.input_tokens + len("<user>hello<assistant>abcde")
        assert follow.previous_response_id == first.id
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(alone.id)  # store: false
        streamed = await client.responses.create(model="fake", input="hi", max_output_tokens=2, stream=True)
        events = [e async for e in streamed]
        final = events[-1].response
        assert (await client.responses.retrieve(final.id)).output_text == "ab"
        with pytest.raises(openai.NotFoundError, match="no stored response"):
            await client.responses.create(model="fake", input="x", previous_response_id="resp_nope",
                                          max_output_tokens=1)
        with pytest.raises(openai.BadRequestError, match="background"):
            await client.responses.cancel(first.id)
        with pytest.raises(openai.BadRequestError, match="prediction is a Chat Completions"):  # never ignored
            await client.responses.create(model="fake", input="x", max_output_tokens=1,
                                          extra_body={"prediction": {"type": "content", "content": "x"}})
        # The input items, as OpenAI lists them back (newest first by default)
        items = await client.responses.input_items.list(first.id)
        assert [(i.type, i.role, i.content[0].text) for i in items.data] == [("message", "user", "hello")]
        listed = [{"role": "user", "content": "one"}, {"role": "assistant", "content": "two"},
                  {"role": "user", "content": "three"}]
        many = await client.responses.create(model="fake", input=listed, max_output_tokens=1)
        page = await client.responses.input_items.list(many.id, order="asc", limit=2)
        assert [i.content[0].text if not isinstance(i.content, str) else i.content for i in page.data] == \
            ["one", "two"] and page.has_more
        rest = await client.responses.input_items.list(many.id, order="asc", after=page.last_id)
        assert len(rest.data) == 1 and not rest.has_more
        # In OpenAI's item shape (they came back as sent: no type, text as a string, any key echoed)
        every = (await client.responses.input_items.list(many.id, order="asc")).data
        assert [i.content[0].type for i in every] == ["input_text", "output_text", "input_text"]
        assert all(i.type == "message" and i.status == "completed" and i.id.startswith("msg_") for i in every)
        assert many.id.startswith("resp_") and isinstance(many.created_at, (int, float))
        with pytest.raises(openai.BadRequestError) as bad:  # a query parameter is named as such (was "query")
            await client.responses.input_items.list(many.id, limit=0)
        assert bad.value.body["param"] == "limit", bad.value.body
        # Items' ids are unique, as OpenAI requires (a repeated one sent the pager round in a loop)
        with pytest.raises(openai.BadRequestError, match="input\\[2\\]: Duplicate item found with id msg_a"):
            await client.responses.create(model="fake", max_output_tokens=1, input=[
                {"type": "message", "id": "msg_a", "role": "user", "content": "hi"},
                {"type": "message", "id": "msg_b", "role": "assistant", "content": "yo"},
                {"type": "message", "id": "msg_a", "role": "user", "content": "again"}])
        # include takes what POST accepts without effect, on both GETs; anything else is refused
        # (retrieve refused every include; input_items ignored any value and any parameter)
        fine = ["reasoning.encrypted_content"]
        assert (await client.responses.retrieve(first.id, include=fine)).id == first.id
        assert (await client.responses.input_items.list(many.id, include=fine)).data
        for call in (client.responses.retrieve(first.id, include=["bogus"]),
                     client.responses.input_items.list(many.id, include=["bogus"])):
            with pytest.raises(openai.BadRequestError) as bad:
                await call
            assert bad.value.body["param"] == "include", bad.value.body
        with pytest.raises(openai.BadRequestError, match="unsupported query parameter"):
            await client.responses.input_items.list(many.id, extra_query={"foo": "1"})
        # A stored response is returned whole: asking for it streamed is refused by name
        with pytest.raises(openai.BadRequestError, match="stream=true"):
            [e async for e in await client.responses.retrieve(first.id, stream=True)]
        await client.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(first.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.delete(first.id)

    run_with_client(fn, ResponseStore())


def test_without_the_store_nothing_is_kept() -> None:
    async def fn(client: openai.AsyncOpenAI):
        r = await client.responses.create(model="fake", input="hello", max_output_tokens=2)
        assert not r.store
        with pytest.raises(openai.NotFoundError, match="--enable-responses-store"):
            await client.responses.retrieve(r.id)
        with pytest.raises(openai.BadRequestError, match="--enable-responses-store"):
            await client.responses.create(model="fake", input="x", previous_response_id=r.id, max_output_tokens=1)

    run_with_client(fn, None)


def test_the_store_drops_the_oldest_past_its_bounds() -> None:
    store = ResponseStore(max_entries=2, max_bytes=10_000)
    for i in range(3):
        store.put({"id": f"r{i}", "text": "x"}, [{"role": "user", "content": "y"}])
    assert store.get("r0") is None and store.get("r1") is not None and store.get("r2") is not None
    store.put({"id": "big", "text": "x" * 6_000}, [])
    assert store.get("r1") is None and store.get("big") is not None  # bytes: the oldest went first
    assert not store.put({"id": "huge", "text": "x" * 20_000}, [])  # larger than the whole store: not kept
    assert store.get("huge") is None and store.get("big") is not None
    assert store.has_room([{"role": "user", "content": "y"}], None)
    assert not store.has_room([{"role": "user", "content": "y" * 20_000}], None)


def test_a_conversation_the_store_cannot_keep_is_refused_before_it_runs() -> None:
    """It was answered with "store": true and never kept: the next previous_response_id
    on it was a 404 "never stored, or dropped"."""
    async def fn(client: openai.AsyncOpenAI):
        with pytest.raises(openai.BadRequestError, match="larger than the response store") as e:
            await client.responses.create(model="fake", input="x" * 3_000, max_output_tokens=2)
        assert e.value.body["param"] == "store"
        r = await client.responses.create(model="fake", input="x" * 3_000, max_output_tokens=2, store=False)
        assert not r.store
        kept = await client.responses.create(model="fake", input="x" * 1_000, max_output_tokens=2)
        assert kept.store and (await client.responses.retrieve(kept.id)).id == kept.id

    run_with_client(fn, ResponseStore(max_bytes=5_000))


def test_the_store_counts_the_memory_it_holds() -> None:
    """A response echoing a field of 200,000 empty lists is ~800 KB of JSON but ~11 MB as
    Python objects: the store keeps the text, so its bound is the memory held."""
    import gc
    import tracemalloc

    store = ResponseStore(max_entries=100, max_bytes=64 << 20)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(5):
            store.put({"id": f"r{i}", "text": {"format": [[] for _ in range(200_000)]}}, [])
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held < 2 * store.num_bytes and store.num_bytes < 5 * 1_000_000, (held, store.num_bytes)
    response, _ = store.get("r4")
    assert len(response["text"]["format"]) == 200_000

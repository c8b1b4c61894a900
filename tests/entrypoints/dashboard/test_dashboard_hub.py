"""The dashboard's event hub over a real engine (fake runner) and its routes in-process;
the page itself is driven in a real browser in test_dashboard_browser.py."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

import pagedserve.entrypoints.dashboard as dashboard
from pagedserve.core.snapshot import block_state
from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.entrypoints.dashboard import DashboardHub
from pagedserve.entrypoints.openai.api_server import Attachment, ServerState, build_app
from pagedserve.metrics import SeriesStatLogger
from pagedserve.sampling_params import SamplingParams
from tests.engine.fake_engine import FakeEngine
from tests.engine.fake_runner import make_engine


def _event(raw: str) -> dict:
    assert raw.startswith("data: ") and raw.endswith("\n\n")
    return json.loads(raw[len("data: "):])


def _slow_engine(step_seconds: float = 0.02, **kwargs):
    """A real LLMEngine whose fake runner takes a while per step, so a request lives across snapshots."""
    engine = make_engine(num_blocks=32, **kwargs)
    execute = engine.model_executor.execute_model

    def slow(so):
        time.sleep(step_seconds)
        return execute(so)

    engine.model_executor.execute_model = slow
    return engine


async def _wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def test_full_picture_then_deltas_that_track_the_pool_and_a_late_page_starts_from_the_mirror():
    async def main():
        engine = _slow_engine()
        llm = AsyncLLM(engine, log_stats=False)
        series = SeriesStatLogger()
        llm.stat_loggers.append(series)
        hub = DashboardHub(llm, series, {"model": "fake"})
        pool = engine.kv_cache_manager.block_pool
        first = hub.events()
        full = _event(await anext(first))
        assert full["type"] == "full" and full["config"] == {"model": "fake"}
        assert [b[0] for b in full["blocks"]] == list(range(32)) and full["null_block_id"] == 0
        assert pool.changed_block_ids is not None  # watched: changes are recorded
        mirror = {b[0]: b for b in full["blocks"]}
        in_use_seen, rows_seen = 0, 0

        async def run():
            async for _ in llm.generate({"prompt_token_ids": list(range(1, 40))}, SamplingParams(max_tokens=30),
                                        "r1"):
                pass

        task = asyncio.ensure_future(run())
        while not task.done() or any(b[1] for b in mirror.values()):
            ev = _event(await asyncio.wait_for(anext(first), 5))
            assert ev["type"] == "delta" and "config" not in ev
            mirror.update({b[0]: b for b in ev["blocks"]})
            in_use_seen = max(in_use_seen, sum(1 for b in mirror.values() if b[1] > 0))
            for row in ev["running"]:
                rows_seen += 1
                assert row["request_id"] == "r1" and row["state"] == "running" and row["prompt_len"] == 39
                assert all(mirror[i][1] >= 1 for i in row["block_ids"])
        await task
        assert in_use_seen >= 3 and rows_seen >= 1  # 39 prompt tokens + outputs in 16-token blocks
        assert [tuple(mirror[i]) for i in range(32)] == [block_state(b) for b in pool.blocks]
        assert any(b[2] is not None for b in mirror.values())  # the finished prompt stays cached

        # Once the request's last second has closed, the series has counted each generated token once.
        await _wait_for(lambda: sum(p["gen_tps"] for p in series.points_since(None)) >= 30)
        assert sum(p["gen_tps"] for p in series.points_since(None)) == 30
        second = hub.events()  # a page opened later: a full picture at once, from the hub's mirror
        late = _event(await asyncio.wait_for(anext(second), 5))
        assert late["type"] == "full" and [tuple(b) for b in late["blocks"]] == [block_state(b) for b in pool.blocks]
        assert late["series"] and late["series"][0] == series.points_since(None)[0]

        await first.aclose()
        await second.aclose()
        await _wait_for(lambda: pool.changed_block_ids is None)  # nobody watches: nothing recorded
        llm.shutdown()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_page_that_stops_reading_is_dropped_and_the_others_go_on(monkeypatch):
    monkeypatch.setattr(dashboard, "MAX_QUEUED_EVENTS", 2)

    async def main():
        llm = AsyncLLM(_slow_engine(), log_stats=False)
        hub = DashboardHub(llm, SeriesStatLogger(), {})
        stuck, reading = hub.events(), hub.events()
        await anext(stuck)
        await anext(reading)
        for _ in range(6):  # 1.5 s of snapshots; `stuck` reads none of them
            await asyncio.wait_for(anext(reading), 5)
        assert len(hub.subscribers) == 1
        got = [e async for e in stuck]  # what it had queued, then the end of its stream
        assert len(got) <= 2
        await asyncio.wait_for(anext(reading), 5)  # the other page still gets events
        await reading.aclose()
        llm.shutdown()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_pages_opening_together_share_one_full_picture_and_past_the_cap_get_a_503(monkeypatch):
    """A full picture is built once per snapshot however many pages open (JSON of every
    block, on the event loop: 300 pages each building their own stalled /health for
    1.9 s), and past MAX_PAGES the route refuses before any stream starts."""
    from pagedserve.errors import OverloadedError

    monkeypatch.setattr(dashboard, "MAX_PAGES", 3)
    built: list[int] = []
    payload = DashboardHub._payload
    monkeypatch.setattr(DashboardHub, "_payload", lambda self, kind, *a: built.append(kind) or payload(self, kind, *a))

    async def main():
        llm = AsyncLLM(_slow_engine(), log_stats=False)
        hub = DashboardHub(llm, SeriesStatLogger(), {})
        first = hub.events()
        await asyncio.wait_for(anext(first), 5)
        hub.check_room()
        late = [hub.events(), hub.events()]
        pictures = [await anext(page) for page in late]  # (queued at once: no loop turn between them)
        assert pictures[0] is pictures[1] and built.count("full") <= 2  # (the first, and at most one rebuilt)
        with pytest.raises(OverloadedError, match="3 dashboard pages are open"):
            hub.check_room()
        # A page that passed check_room with others at once, past the cap: an error event, then the end.
        extra = hub.events()
        assert _event(await anext(extra))["type"] == "error" and [e async for e in extra] == []
        assert len(hub.subscribers) == 3
        for page in [first, *late]:
            await page.aclose()
        hub.check_room()
        llm.shutdown()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_one_address_holds_at_most_its_share_of_the_pages(monkeypatch):
    """32 connections that never read held every slot (a page is dropped only once its
    queue fills, hours of small deltas through the socket buffers): one address gets
    MAX_PAGES_PER_ADDRESS of them, the others still open pages, and a closed page frees
    its address's slot."""
    from pagedserve.errors import OverloadedError

    monkeypatch.setattr(dashboard, "MAX_PAGES_PER_ADDRESS", 2)

    async def main():
        llm = AsyncLLM(_slow_engine(), log_stats=False)
        hub = DashboardHub(llm, SeriesStatLogger(), {})
        greedy = [hub.events("10.0.0.9"), hub.events("10.0.0.9")]
        for page in greedy:
            await asyncio.wait_for(anext(page), 5)
        with pytest.raises(OverloadedError, match="2 dashboard pages are open from this address"):
            hub.check_room("10.0.0.9")
        extra = hub.events("10.0.0.9")  # (one that passed check_room with the others at once)
        assert "from this address" in _event(await anext(extra))["message"] and [e async for e in extra] == []
        hub.check_room("10.0.0.7")
        other = hub.events("10.0.0.7")
        await asyncio.wait_for(anext(other), 5)
        await greedy[0].aclose()
        hub.check_room("10.0.0.9")
        assert hub.pages_by_address == {"10.0.0.9": 1, "10.0.0.7": 1}
        for page in (greedy[1], other):
            await page.aclose()
        assert hub.pages_by_address == {} and not hub.subscribers
        llm.shutdown()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_close_ends_every_page_stream_and_stops_the_watching():
    async def main():
        engine = _slow_engine()
        llm = AsyncLLM(engine, log_stats=False)
        hub = DashboardHub(llm, SeriesStatLogger(), {})
        pages = [hub.events(), hub.events()]
        for page in pages:
            await asyncio.wait_for(anext(page), 5)
        hub.close()  # what a draining server does
        for page in pages:
            assert [e async for e in page] == []
        assert not hub.subscribers
        await _wait_for(lambda: engine.kv_cache_manager.block_pool.changed_block_ids is None)
        llm.shutdown()

    asyncio.run(asyncio.wait_for(main(), 60))


def _app(enable_dashboard: bool = True):
    state = ServerState(served_model_names=["fake"], api_key="secret", enable_dashboard=enable_dashboard)
    app = build_app(state)
    state.attach(Attachment.local(AsyncLLM(FakeEngine(), log_stats=False), 64))
    return app


def _get(app, *paths: str, key: str | None = None) -> list[httpx.Response]:
    async def main():
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return [await client.get(p, headers=headers) for p in paths]

    return asyncio.run(asyncio.wait_for(main(), 30))


def test_the_page_is_public_and_its_event_stream_needs_the_key():
    page, root, js, css, events, health = _get(_app(), "/dashboard", "/", "/dashboard/static/dashboard.js",
                                               "/dashboard/static/dashboard.css", "/dashboard/events", "/health")
    assert page.status_code == root.status_code == 200 and "text/html" in page.headers["content-type"]
    assert page.text == root.text and "/dashboard/static/dashboard.js" in page.text
    assert js.status_code == 200 and "javascript" in js.headers["content-type"] and "/dashboard/events" in js.text
    assert css.status_code == 200 and "text/css" in css.headers["content-type"]
    assert events.status_code == 401 and "API key" in events.json()["error"]["message"]
    assert health.status_code == 200
    # never framed by another site (the playground holds a key and sends on a click), never sniffed
    for r in (page, root, js, css):
        assert r.headers["x-frame-options"] == "DENY" and r.headers["x-content-type-options"] == "nosniff"
        assert r.headers["content-security-policy"] == "frame-ancestors 'none'"


@pytest.mark.parametrize("path", ["/dashboard/static/missing.js", "/dashboard/static/..%2Fmetrics",
                                  "/dashboard/static/" + "x" * 300 + ".js",  # ENAMETOOLONG was a 500
                                  "/dashboard/static/.hidden.js", "/dashboard/static/__init__.py"])
def test_only_the_shipped_static_files_are_served(path):
    (r,) = _get(_app(), path)
    assert r.status_code == 404


def test_disable_dashboard_removes_the_page_and_its_stream():
    page, root, events = _get(_app(enable_dashboard=False), "/dashboard", "/", "/dashboard/events", key="secret")
    assert page.status_code == events.status_code == 404
    assert root.status_code == 200 and root.text == "pagedserve is running"  # (Ollama's check, not the page)
    (page,) = _get(_app(enable_dashboard=False), "/dashboard")  # and it is no longer public
    assert page.status_code == 401

"""The live dashboard and chat playground that `pagedserve serve` shows at `/`.

The page (static/, plain HTML, CSS and JavaScript shipped in the package: installs
here have no internet for a CDN) reads one Server-Sent Events stream,
`/dashboard/events`.  `DashboardHub` produces it on the event loop: while at least one
page is open it asks the engine to publish a snapshot every 250 ms (AsyncLLM.watch;
the first full, then only the KV blocks that changed), keeps a mirror of the block
pool so a page that opens later starts from a full picture, and adds the per-second
points of `SeriesStatLogger`.  Nobody watching: the engine records nothing.

The page itself and its static files are public (the page asks for the API key);
the event stream, like every API route, needs the key (router.py serves all three).
The playground talks to /v1/chat/completions like any client.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import asdict
from typing import Any

from pagedserve.core.snapshot import KVSnapshot
from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.errors import OverloadedError
from pagedserve.metrics import SeriesStatLogger

logger = logging.getLogger("pagedserve.dashboard")

PAGE_PATHS = ("/", "/dashboard")
STATIC_PREFIX = "/dashboard/static/"
EVENTS_PATH = "/dashboard/events"
# Events queued for one page before it counts as stuck and is dropped (its browser
# reconnects and starts again from a full picture): 16 s of snapshots.
MAX_QUEUED_EVENTS = 64
# Pages one hub streams to at once; more get a 503 (each holds a connection and a queue,
# and every snapshot is put on each page's queue on the event loop).
MAX_PAGES = 32
# Pages from one client address: a page that stops reading is dropped only once its queue
# fills, which small delta events take hours to do through the kernel's socket buffers, so
# 32 connections that never read held every slot (a lockout of every other viewer).
MAX_PAGES_PER_ADDRESS = 8


def is_public_path(path: str) -> bool:
    """The page and its files: served without the API key (the page asks for it)."""
    return path in PAGE_PATHS or path.startswith(STATIC_PREFIX)


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


class DashboardHub:
    """Fans the engine's snapshots out to the open pages (event loop only)."""

    def __init__(self, engine: AsyncLLM, series: SeriesStatLogger, config: dict[str, Any]) -> None:
        self.engine = engine
        self.series = series
        self.config = config
        self.subscribers: set[asyncio.Queue[str | None]] = set()
        self.pages_by_address: dict[str, int] = {}
        # [ref_cnt, hash prefix] per block: valid from the first full snapshot after the
        # first page opened until the last one closed (None otherwise).
        self.blocks: list[list[Any]] | None = None
        self.latest: KVSnapshot | None = None
        # The full picture as an event, built once per snapshot however many pages open
        # (a large pool's is ~230 KB of JSON: 300 pages opening at once, each building its
        # own on the event loop, stalled /health for 1.9 s).
        self._full: str | None = None
        self._series_t: float | None = None  # newest series point already sent
        # Seconds the server has spent on the dashboard's data (the engine thread taking
        # snapshots, the event loop turning them into events): sent with every event, so
        # the page (and bench_dashboard) can show what watching costs.
        self.cost_seconds = 0.0

    async def events(self, address: str = "") -> AsyncIterator[str]:
        """One page's stream (from client `address`): a full picture, then deltas, until
        it disconnects (the route calls check_room first; pages that passed it together
        past a cap get an error event and the end of their stream, here, where they
        would be counted)."""
        full = self._full_for(address)
        if full is not None:
            yield _sse({"type": "error", "message": full})
            return
        queue: asyncio.Queue[str | None] = asyncio.Queue(maxsize=MAX_QUEUED_EVENTS)
        first = not self.subscribers
        self.subscribers.add(queue)
        self.pages_by_address[address] = self.pages_by_address.get(address, 0) + 1
        try:
            if first:
                self.engine.watch(self._on_snapshot)  # its first snapshot is full: broadcast to all
            elif self.blocks is not None:
                queue.put_nowait(self._full_event())
            while True:
                event = await queue.get()
                if event is None:  # dropped as too slow: the browser reconnects
                    return
                yield event
        finally:
            self.subscribers.discard(queue)
            left = self.pages_by_address.pop(address) - 1
            if left:
                self.pages_by_address[address] = left
            if not self.subscribers:
                self.engine.watch(None)
                self.blocks = self.latest = self._full = None

    def check_room(self, address: str = "") -> None:
        """OverloadedError (a 503, before the stream starts) past MAX_PAGES open pages, or
        MAX_PAGES_PER_ADDRESS from `address`."""
        full = self._full_for(address)
        if full is not None:
            raise OverloadedError(f"{full}; close one, or retry later")

    def _full_for(self, address: str) -> str | None:
        """Why a page from `address` cannot open now; None: it can."""
        if len(self.subscribers) >= MAX_PAGES:
            return f"{MAX_PAGES} dashboard pages are open"
        if self.pages_by_address.get(address, 0) >= MAX_PAGES_PER_ADDRESS:
            return f"{MAX_PAGES_PER_ADDRESS} dashboard pages are open from this address"
        return None

    def _full_event(self) -> str:
        assert self.blocks is not None and self.latest is not None
        if self._full is None:
            blocks = [[i, ref, digest] for i, (ref, digest) in enumerate(self.blocks)]
            self._full = _sse(self._payload("full", self.latest, blocks, self.series.points_since(None)))
        return self._full

    def _payload(self, kind: str, snap: KVSnapshot, blocks: list[Any], series: list[dict[str, Any]]) -> dict:
        return {
            "type": kind, "blocks": blocks, "series": series,
            "num_blocks": snap.num_blocks, "block_size": snap.block_size, "null_block_id": snap.null_block_id,
            "running": [asdict(r) for r in snap.running], "waiting": [asdict(r) for r in snap.waiting],
            "num_running": snap.num_running, "num_waiting": snap.num_waiting, "cost_seconds": self.cost_seconds,
            **({"config": self.config} if kind == "full" else {}),
        }

    def _on_snapshot(self, snap: KVSnapshot, engine_seconds: float) -> None:
        if not self.subscribers:
            return
        t0 = time.perf_counter()
        self.cost_seconds += engine_seconds
        series = self.series.points_since(self._series_t)
        if series:
            self._series_t = series[-1]["t"]
        self._full = None  # (the picture moves on with every snapshot)
        if snap.full:
            self.blocks = [[ref, digest] for _, ref, digest in snap.blocks]
            self.latest = snap
            event = self._full_event()
        elif self.blocks is None:  # a delta from before the last page closed
            return
        else:
            for block_id, ref, digest in snap.blocks:
                self.blocks[block_id] = [ref, digest]
            self.latest = snap
            event = _sse(self._payload("delta", snap, [list(b) for b in snap.blocks], series))
        self.cost_seconds += time.perf_counter() - t0
        for queue in list(self.subscribers):
            try:
                queue.put_nowait(event)
            except asyncio.QueueFull:
                logger.warning("a dashboard page fell %d events behind; dropping it (it reconnects)",
                               MAX_QUEUED_EVENTS)
                self._end(queue)

    def _end(self, queue: asyncio.Queue[str | None]) -> None:
        """End one page's stream after what it has already read."""
        while not queue.empty():
            queue.get_nowait()
        queue.put_nowait(None)
        self.subscribers.discard(queue)

    def close(self) -> None:
        """End every page's stream (the server is shutting down: open streams would hold it)."""
        for queue in list(self.subscribers):
            self._end(queue)

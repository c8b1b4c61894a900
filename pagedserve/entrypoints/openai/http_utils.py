"""ASGI plumbing of the server: SSE streaming that notices disconnects, cancelling
non-streaming handlers whose client left, the API-key check, and error responses."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedserve.entrypoints.openai.serving_engine import OpenAIError


def error_response(err: OpenAIError) -> JSONResponse:
    return JSONResponse(err.to_response().model_dump(), status_code=err.status)


class SSEResponse(StreamingResponse):
    """Streams SSE and watches for the client going away even while no token is being
    sent (starlette's default only notices on the next write), so a disconnect aborts the
    request at once; the body iterator is always closed, which aborts it in the engine."""

    def __init__(self, content: AsyncIterator[str]) -> None:
        super().__init__(content, media_type="text/event-stream")

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            async with anyio.create_task_group() as tg:
                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:
                        pass  # the client went away mid-write
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()


class APIKeyMiddleware:
    """Bearer-token check on /v1/* as plain ASGI (BaseHTTPMiddleware would put every
    streamed chunk through an extra task and memory stream)."""

    def __init__(self, app: Any, state: Any) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        key = self.state.api_key
        if key and scope["type"] == "http" and scope["path"].startswith("/v1"):
            header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            scheme, _, token = header.partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), key.encode()):
                err = OpenAIError("Invalid or missing API key (send 'Authorization: Bearer <key>').",
                                  status=401, code="invalid_api_key")
                await error_response(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def cancel_on_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """Run a non-streaming handler, cancelling it (and so aborting its engine requests)
    if the client disconnects first."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task.cancelled():
        return Response(status_code=499)
    return task.result()

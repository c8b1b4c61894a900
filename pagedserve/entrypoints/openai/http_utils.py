"""ASGI plumbing of the server: SSE streaming that notices disconnects, cancelling
non-streaming handlers whose client left, the API-key check, the request-body limit
and error responses."""

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
    return JSONResponse(err.to_response().model_dump(), status_code=err.status, headers=err.headers)


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
    """Bearer-token check on every route but the state's public ones (`state.is_public`:
    /health, /metrics with `metrics_without_auth`, the dashboard page), as plain ASGI (BaseHTTPMiddleware would put every streamed
    chunk through an extra task and memory stream).  The comparison takes constant time."""

    def __init__(self, app: Any, state: Any) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        key = self.state.api_key
        if key and scope["type"] == "http" and not self.state.is_public(scope["path"]):
            header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            scheme, _, token = header.partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), key.encode()):
                err = OpenAIError("Invalid or missing API key (send 'Authorization: Bearer <key>').",
                                  status=401, code="invalid_api_key")
                await error_response(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Refuses request bodies over `max_bytes` with a 413 before they are parsed: by
    Content-Length at once, or, for a chunked body, as soon as the bytes read pass the
    limit (so a 50 MB body never sits in memory).  A chunked body under the limit is
    handed on whole, then the connection's later messages (disconnects) pass through."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    def _too_large(self) -> JSONResponse:
        return error_response(OpenAIError(
            f"The request body is larger than this server's limit of {self.max_bytes} bytes "
            "(--max-request-bytes).", status=413, code="request_too_large"))

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            if not length.isdigit():
                await error_response(OpenAIError("Content-Length is not a number"))(scope, receive, send)
            elif int(length) > self.max_bytes:
                await self._too_large()(scope, receive, send)
            else:  # the HTTP parser holds the client to its Content-Length
                await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left while sending
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._too_large()(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        first: list[dict] = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay() -> dict:
            return first.pop() if first else await receive()

        await self.app(scope, replay, send)


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
            await asyncio.wait({task})  # let the cancellation run (it aborts the engine requests)
    if task.cancelled():
        return Response(status_code=499)
    return task.result()

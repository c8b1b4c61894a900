"""The one way a generation route answers: prepare the request off the event loop, let
the engine accept it, then stream or answer once, all cancelled if the client leaves.
Shared by the OpenAI routers, the pooling routes and Anthropic's /v1/messages."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from pagedserve.engine.async_llm import RequestStream
from pagedserve.entrypoints.openai.http_utils import SSEResponse, cancel_on_disconnect, route_path
from pagedserve.entrypoints.openai.model_pool import UNSET, Lease
from pagedserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, RequestBody
from pagedserve.entrypoints.openai.server_state import ModelHandlers, ServerState

logger = logging.getLogger("pagedserve.api_server")


class ServingHandler(Protocol):
    """One generation endpoint's handler (OpenAIServing's subclasses, and the Responses
    and Anthropic translations onto the chat handler): what `generate` calls, in order."""

    def warn_unknown_fields(self, req: Any) -> None: ...

    def prepare(self, req: Any) -> Any: ...

    async def start(self, req: Any, prep: Any) -> tuple[str, list[RequestStream]]: ...

    def stream(self, req: Any, prep: Any, request_id: str, streams: list[RequestStream]) -> AsyncIterator[str]: ...

    async def full(self, req: Any, prep: Any, request_id: str, streams: list[RequestStream]) -> Any: ...


def json_response(model: BaseModel) -> JSONResponse:
    return JSONResponse(model.model_dump())


class ReleasingStream:
    """A response's stream that releases its model's lease when it ends or is closed
    (the response classes always close their body iterator, started or not)."""

    def __init__(self, inner: AsyncIterator[str], lease: Lease[ModelHandlers]) -> None:
        self.inner, self.lease = inner, lease

    def __aiter__(self) -> ReleasingStream:
        return self

    async def __anext__(self) -> str:
        try:
            return await self.inner.__anext__()
        except BaseException:
            self.lease.release()
            raise

    async def aclose(self) -> None:
        try:
            if isinstance(self.inner, AsyncGenerator):  # (a plain iterator has nothing to close)
                await self.inner.aclose()
        finally:
            self.lease.release()


def json_head(value: Any, limit: int) -> tuple[str, bool]:
    """The first `limit` characters of `value` as JSON, and whether it was cut: its strings
    clipped to the limit, then encoded piece by piece, stopping past it (a 30 MB body was
    encoded whole on the event loop to log its first 2,000 characters)."""
    def clipped(v: Any) -> Any:
        if isinstance(v, str):
            return v[:limit + 1]
        if isinstance(v, dict):
            return {k: clipped(x) for k, x in v.items()}
        return [clipped(x) for x in v] if isinstance(v, list) else v

    pieces, size = [], 0
    for piece in json.JSONEncoder(ensure_ascii=False).iterencode(clipped(value)):
        pieces.append(piece)
        size += len(piece)
        if size > limit:
            return "".join(pieces)[:limit], True
    return "".join(pieces), False


async def generate(state: ServerState, pick: Callable[[ModelHandlers], ServingHandler], body: RequestBody,
                   request: Request, *, runner: str = "generate", route: str = "", keep_alive: Any = UNSET,
                   chat: str | None = None, images: str | None = None,
                   stream_class: Callable[[AsyncIterator[str]], Response] = SSEResponse) -> Response:
    """Every generation endpoint: lease the model the body names (loading it if need
    be), validate and render off the event loop (templates and tokenizing a long prompt
    take seconds), let the engine accept the request (its refusals are 400s, before any
    byte is sent), then stream (`stream_class`: SSE) or answer once.  A client that
    leaves at any point cancels it all, which aborts every engine request it started (a
    20,000-prompt fan-out included).  The model stays leased until the answer ends."""
    if isinstance(body, ChatCompletionRequest | CompletionRequest):
        body.to_sampling_params()  # (the ranges that need no model, before it loads: a bad request unloads nothing)
    lease = await state.lease(body.model, runner, route or route_path(request.scope), keep_alive, chat, request,
                              body.image_field() or images)
    streaming: list[ReleasingStream] = []
    try:
        serving = pick(lease.handlers)
        serving.warn_unknown_fields(body)

        async def handle() -> Response | BaseModel | dict:
            prep = await state.prepare.run_for(body, serving.prepare, body)
            request_id, streams = await serving.start(body, prep)
            if state.log_requests is not None:  # (--enable-log-requests; prompts are never logged without it)
                shown, cut = json_head(body.model_dump(exclude_unset=True), state.log_requests)
                logger.info("request %s accepted on %s: %s%s", request_id, route_path(request.scope), shown,
                            "..." if cut else "")
            if body.stream:
                streaming.append(ReleasingStream(serving.stream(body, prep, request_id, streams), lease))
                return stream_class(streaming[0])
            return await serving.full(body, prep, request_id, streams)

        result = await cancel_on_disconnect(request, handle())
    finally:
        if not streaming:
            lease.release()
    if isinstance(result, dict):  # (the Responses API's objects are plain dicts)
        return JSONResponse(result)
    return result if isinstance(result, Response) else json_response(result)

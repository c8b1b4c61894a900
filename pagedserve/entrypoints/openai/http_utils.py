"""ASGI plumbing of the server: SSE streaming that notices disconnects, cancelling
handlers whose client left, the Host and API-key checks, the request-body limit and
read deadline, the HTTP protocol's header deadline, X-Request-Id on answers (and
Anthropic's request-id on its routes), and error
responses."""

from __future__ import annotations

import asyncio
import ipaddress
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import anyio
import h11
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import get_route_path
from uvicorn.protocols.http.h11_impl import H11Protocol

from pagedserve.entrypoints.anthropic.protocol import ANTHROPIC_PATH_PREFIX, anthropic_error_body
from pagedserve.entrypoints.ollama.protocol import OLLAMA_PATH_PREFIX
from pagedserve.entrypoints.openai.json_body import check_json_body
from pagedserve.entrypoints.openai.protocol_fields import check_request_id
from pagedserve.entrypoints.openai.serving_engine import ModelNotFoundError, OpenAIError
from pagedserve.errors import InvalidRequestError
from pagedserve.request_limits import MAX_BODY_PIECES, MIN_BODY_PIECE_BYTES


def error_response(err: OpenAIError, path: str = "") -> JSONResponse:
    """OpenAI's error shape; Anthropic's and Ollama's on the routes of their APIs (`path`)."""
    if path.startswith(ANTHROPIC_PATH_PREFIX):
        body = anthropic_error_body(err.status, err.message)
    elif path.startswith(OLLAMA_PATH_PREFIX):
        body = {"error": f"model '{err.model}' not found" if isinstance(err, ModelNotFoundError) else err.message}
    else:
        body = err.to_response().model_dump()
    return JSONResponse(body, status_code=err.status, headers=err.headers)


def route_path(scope: Any) -> str:
    """The request's path as the routes see it: without a proxy's --root-path prefix,
    which uvicorn puts in front of scope["path"] (then /health asked for the key)."""
    return get_route_path(scope)


class SSEResponse(StreamingResponse):
    """Streams SSE and watches for the client going away even while no token is being
    sent (starlette's default only notices on the next write), so a disconnect aborts the
    request at once; the body iterator is always closed, which aborts it in the engine."""

    media = "text/event-stream"

    def __init__(self, content: AsyncIterator[str]) -> None:
        super().__init__(content, media_type=self.media)

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


class NDJSONResponse(SSEResponse):
    """Newline-delimited JSON (Ollama's streams), with SSEResponse's disconnect watch."""

    media = "application/x-ndjson"


class APIKeyMiddleware:
    """API-key check (a bearer token, or Anthropic's x-api-key header) on every route but
    the state's public ones (`state.is_public`: /health, /metrics with
    `metrics_without_auth`, the dashboard page), as plain ASGI (BaseHTTPMiddleware would
    put every streamed chunk through an extra task and memory stream).  The comparison takes constant time
    and is of bytes: the header as sent against the key's UTF-8 (the server refuses a
    key with characters HTTP clients cannot send)."""

    def __init__(self, app: Any, state: Any) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        key = self.state.api_key
        if key and scope["type"] == "http" and not self.state.is_public(route_path(scope)):
            headers = dict(scope["headers"])
            scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer":  # Anthropic's clients send the key as x-api-key
                token = headers.get(b"x-api-key", b"")
            if not secrets.compare_digest(token.strip(), key.encode()):
                err = OpenAIError("Invalid or missing API key (send 'Authorization: Bearer <key>' or "
                                  "'x-api-key: <key>').", status=401, code="invalid_api_key")
                await error_response(err, route_path(scope))(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _with_header(send: Any, name: bytes, value: bytes) -> Any:
    """`send` adding the header `name: value` to the answer's start."""
    async def sending(message: dict) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), (name, value)]}
        await send(message)

    return sending


class RequestIdHeaderMiddleware:
    """vLLM's --enable-request-id-headers: every answer carries X-Request-Id, the request's
    own (when check_request_id takes it), else a new one."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")  # (HTTP's header bytes)
        try:
            value = check_request_id(given).encode("latin-1")  # the one rule for a client's request id
        except InvalidRequestError:
            value = uuid.uuid4().hex.encode()
        await self.app(scope, receive, _with_header(send, b"x-request-id", value))


# The routes that put work on an engine: what vLLM's /load counts (not tokenizing, admin
# or listing routes).
LOAD_AWARE_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
                              "/v1/embeddings", "/v1/score", "/score", "/v1/rerank", "/rerank", "/v2/rerank",
                              "/api/chat", "/api/generate", "/api/embed", "/api/embeddings"})


class ServerLoadMiddleware:
    """vLLM's --enable-server-load-tracking: `state.server_load` counts the requests on
    LOAD_AWARE_PATHS from their arrival until their answer's last byte (a stream's too),
    for GET /load (a router's cheap signal)."""

    def __init__(self, app: Any, state: Any) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or route_path(scope) not in LOAD_AWARE_PATHS:
            await self.app(scope, receive, send)
            return
        self.state.server_load += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.server_load -= 1


_HTTP_METHODS = frozenset({"GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS", "PATCH"})


class HttpMetricsMiddleware:
    """vLLM's HTTP series on /metrics (prometheus-fastapi-instrumentator's names): requests
    by method, status class and route (its template: /v1/models/{model_id:path}), and
    their durations to the answer's last byte.  A path no route matched counts as handler
    "none" and an unknown method as "OTHER", so a scan of made-up URLs adds no series."""

    def __init__(self, app: Any, registry: Any) -> None:
        from prometheus_client import Counter, Histogram

        self.app = app
        self.requests = Counter("http_requests", "Total number of requests by method, status and handler.",
                                ["method", "status", "handler"], registry=registry)
        self.duration = Histogram("http_request_duration_seconds", "Latency with only few buckets by handler.",
                                  ["method", "handler"], buckets=(0.1, 0.5, 1, 5, 30, 120), registry=registry)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status, start = 500, time.monotonic()

        async def sending(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            handler = getattr(scope.get("route"), "path", None) or "none"  # (FastAPI's router sets the route)
            method = scope["method"] if scope["method"] in _HTTP_METHODS else "OTHER"
            self.requests.labels(method, f"{status // 100}xx", handler).inc()
            self.duration.labels(method, handler).observe(time.monotonic() - start)


class AnthropicRequestIdMiddleware:
    """Anthropic's API answers every /v1/messages request with a `request-id` header
    (req_...): its client reads it into `message._request_id` and error objects'
    `request_id`, which users log when they report a failure."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not route_path(scope).startswith(ANTHROPIC_PATH_PREFIX):
            await self.app(scope, receive, send)
            return
        await self.app(scope, receive, _with_header(send, b"request-id", f"req_{uuid.uuid4().hex}".encode()))


LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def default_allowed_hosts(bind_host: str) -> frozenset[str] | None:
    """The Host header values a server bound to `bind_host` answers by default: the
    address it is bound to and the loopback names; None (any) when it is bound to every
    interface, where the names clients use cannot be known."""
    host = bind_host.strip("[]").lower()
    if host in ("", "0.0.0.0", "::"):
        return None
    return frozenset({host, *LOOPBACK_NAMES})


def parse_allowed_hosts(value: str | None, bind_host: str) -> frozenset[str] | None:
    """--allowed-hosts: comma-separated names or addresses, '*' for any; unset: the default."""
    if value is None:
        return default_allowed_hosts(bind_host)
    names = [n.strip().strip("[]").lower() for n in value.split(",") if n.strip()]
    if not names:
        raise ValueError("--allowed-hosts needs at least one name, or '*' for any")
    return None if "*" in names else frozenset(names)


def _host_name(header: bytes) -> str:
    """The host part of a Host header (without its port; an IPv6 address unbracketed)."""
    text = header.decode("latin-1").strip().lower()
    if text.startswith("["):
        return text[1:text.find("]")] if "]" in text else text
    name, sep, port = text.rpartition(":")
    return name if sep and port.isdigit() else text


class HostCheckMiddleware:
    """Answers only requests whose Host header names this server (DNS rebinding: a web
    page whose domain resolves to 127.0.0.1 would otherwise reach a local server through
    the visitor's browser).  `allowed`: names and addresses, None for any; any loopback
    address is allowed wherever one of the loopback names is."""

    def __init__(self, app: Any, state: Any) -> None:
        self.app, self.state = app, state

    def _allowed(self, name: str) -> bool:
        allowed = self.state.allowed_hosts
        if allowed is None or name in allowed:
            return True
        if "localhost" in allowed:
            try:
                return ipaddress.ip_address(name).is_loopback
            except ValueError:
                return False
        return False

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and self.state.allowed_hosts is not None:
            header = dict(scope["headers"]).get(b"host")
            if header is not None and not self._allowed(_host_name(header)):
                shown = header.decode("latin-1")[:100]
                err = OpenAIError(f"The Host header {shown!r} does not name this server; start it with "
                                  "--allowed-hosts listing the names clients use (or '*').", status=400,
                                  code="invalid_host")
                await error_response(err, route_path(scope))(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Reads every request body before the app sees it, within two bounds: `max_bytes`
    (a 413: by Content-Length at once, or for a chunked body as soon as the bytes read
    pass it, so a 50 MB body never sits in memory) and `read_timeout` seconds (a 408: a
    client trickling its body, slowloris, holds nothing for long).  The body is then
    handed on whole, once its JSON shape is within bounds (json_body.py: a 400 before
    anything parses it), and the connection's later messages (disconnects) pass through."""

    def __init__(self, app: Any, max_bytes: int, read_timeout: float | None = None) -> None:
        self.app, self.max_bytes, self.read_timeout = app, max_bytes, read_timeout

    def _too_large(self, path: str) -> JSONResponse:
        return error_response(OpenAIError(
            f"The request body is larger than this server's limit of {self.max_bytes} bytes "
            "(--max-request-bytes).", status=413, code="request_too_large"), path)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        encoding = headers.get(b"content-encoding", b"identity").strip().lower()
        if encoding != b"identity":  # (it was read as the JSON text: a misleading "not UTF-8", or ignored)
            await error_response(OpenAIError(f"Content-Encoding {encoding.decode('latin-1')[:40]!r} is not supported: "
                                             "send the body uncompressed", status=415, code="unsupported_media_type"),
                                 route_path(scope))(scope, receive, send)
            return
        length = headers.get(b"content-length")
        if length is not None:
            if not length.isdigit():
                await error_response(OpenAIError("Content-Length is not a number"), route_path(scope))(scope, receive, send)
                return
            if int(length) > self.max_bytes:
                await self._too_large(route_path(scope))(scope, receive, send)
                return
        loop = asyncio.get_running_loop()
        deadline = None if self.read_timeout is None else loop.time() + self.read_timeout
        chunks: list[bytes] = []
        size = 0
        while True:
            try:
                left = None if deadline is None else max(0.0, deadline - loop.time())
                message = await asyncio.wait_for(receive(), left)
            except TimeoutError:
                await error_response(OpenAIError(
                    f"The request body did not arrive within {self.read_timeout:g} s (--http-read-timeout).",
                    status=408, code="request_timeout"), route_path(scope))(scope, receive, send)
                return
            if message["type"] != "http.request":  # the client left while sending
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._too_large(route_path(scope))(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        try:
            check_json_body(body)  # before FastAPI parses it on this loop
            json_on_ollama_paths(scope)
            check_json_content_type(scope, body)
        except InvalidRequestError as e:
            await error_response(OpenAIError(str(e), param=e.param), route_path(scope))(scope, receive, send)
            return
        first: list[dict] = [{"type": "http.request", "body": body, "more_body": False}]

        async def replay() -> dict:
            return first.pop() if first else await receive()

        await self.app(scope, replay, send)


def check_json_content_type(scope: dict[str, Any], body: bytes) -> None:
    """A body sent as another type (curl's -d sends a form) is named as such, rather than
    left to FastAPI, whose error was "body: Input should be a valid dictionary"; one sent
    with no Content-Type (`requests.post(url, data=text)`) is read as JSON, the type is
    set here.  JSON types are FastAPI's: application/json and application/*+json (it reads
    no other as JSON: text/json and application/jsonl met the same unnamed error)."""
    if not body:
        return
    headers = dict(scope["headers"])
    if b"content-type" not in headers:
        scope["headers"] = [*scope["headers"], (b"content-type", b"application/json")]
        return
    content_type = headers[b"content-type"].decode("latin-1")
    media = content_type.split(";", 1)[0].strip().lower()
    main, _, sub = media.partition("/")
    if main != "application" or not (sub == "json" or sub.endswith("+json")):
        raise InvalidRequestError(f"the request body must be JSON, sent with Content-Type: application/json (it was "
                                  f"sent as {content_type[:100]!r})")


def json_on_ollama_paths(scope: dict[str, Any]) -> None:
    """Ollama's bodies are JSON whatever Content-Type says (its documented `curl -d`
    sends a form type): on its paths the body is read as JSON.  The scope is changed in
    place: the middleware outside reads what the router writes into it (the route)."""
    if route_path(scope).startswith(OLLAMA_PATH_PREFIX):
        headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
        scope["headers"] = [*headers, (b"content-type", b"application/json")]


class BodyPieces:
    """A connection's current request body, counted as h11 parses it: the refusal for a
    body of too many tiny pieces (request_limits.MAX_BODY_PIECES), else None."""

    def __init__(self) -> None:
        self.pieces = self.bytes = 0

    def refusal(self, event: Any) -> str | None:
        if isinstance(event, h11.Request):
            self.pieces = self.bytes = 0
        elif isinstance(event, h11.Data):
            self.pieces += 1
            self.bytes += len(event.data)
            if self.pieces > MAX_BODY_PIECES and self.bytes < self.pieces * MIN_BODY_PIECE_BYTES:
                return (f"The request body came in more than {MAX_BODY_PIECES} chunks of under {MIN_BODY_PIECE_BYTES} "
                        "bytes on average: send it in fewer, larger ones.")
        return None


def header_timeout_protocol(seconds: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection whose request headers have not all
    arrived `seconds` after it opened or after its last response (uvicorn's keep-alive
    timer is cancelled by any byte, so a client sending one byte a minute held a
    connection forever), and answering a 400 to a body of too many tiny chunks
    (request_limits.MAX_BODY_PIECES: each costs the event loop its parsing)."""

    class HeaderTimeoutH11(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None
        _refusal: str | None = None

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_header_timer()
            next_event, pieces = self.conn.next_event, BodyPieces()

            def counted() -> Any:
                event = next_event()
                self._refusal = pieces.refusal(event)
                if self._refusal is not None:
                    raise h11.RemoteProtocolError(self._refusal)  # (uvicorn answers it with a 400)
                return event

            self.conn.next_event = counted

        def send_400_response(self, msg: str) -> None:
            super().send_400_response(self._refusal or msg)

        def on_response_complete(self) -> None:
            super().on_response_complete()  # may start a pipelined request already buffered
            if self.cycle is None or self.cycle.response_complete:
                self._arm_header_timer()

        def handle_events(self) -> None:
            scope = self.scope
            super().handle_events()
            if self.scope is not scope:  # a request's headers are in
                self._disarm_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_header_timer()
            super().connection_lost(exc)

        def _arm_header_timer(self) -> None:
            self._disarm_header_timer()
            self._header_timer = self.loop.call_later(seconds, self._headers_too_slow)

        def _disarm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                self.transport.close()

    return HeaderTimeoutH11


async def cancel_on_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """Run a handler, cancelling it (and so aborting its engine requests) if the client
    disconnects first."""
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

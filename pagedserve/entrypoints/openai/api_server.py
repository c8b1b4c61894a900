"""OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, /v1/responses,
/v1/models, Anthropic's /v1/messages (and count_tokens), /health, /metrics, /tokenize,
/detokenize, /version, and the dashboard at / (see entrypoints/dashboard).

Implementation: the FastAPI app factory (`build_app`) and `run_server`.  The socket is
bound and /health answers 503 while the model loads in a background thread, so
orchestrators see "not ready" rather than "connection refused".

What happens under faults: if the engine loop dies, every open request gets an error
(a 503, or an error event on its stream), /health turns 503 and the process exits
with status 1 so a supervisor restarts it.  SIGTERM/SIGINT drain: new requests get
503, running ones finish until --shutdown-timeout, the rest end with an error event,
and the process exits 0; a second signal exits at once.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

import pagedserve
from pagedserve.engine.async_llm import (
    AsyncLLM,
    EngineDeadError,
    EngineShutdownError,
    RequestTimeoutError,
    check_front_door_limits,
)
from pagedserve.engine.protocol import EngineClient
from pagedserve.entrypoints.anthropic.protocol import CountTokensRequest, MessagesRequest
from pagedserve.entrypoints.anthropic.serving_messages import AnthropicServingMessages
from pagedserve.entrypoints.dashboard import DashboardHub, add_dashboard_routes, is_public_path
from pagedserve.entrypoints.openai.http_utils import (
    APIKeyMiddleware,
    BodyLimitMiddleware,
    HostCheckMiddleware,
    SSEResponse,
    cancel_on_disconnect,
    error_response,
    header_timeout_protocol,
    parse_allowed_hosts,
)
from pagedserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    RerankRequest,
    ResponsesRequest,
    ScoreRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)
from pagedserve.entrypoints.openai.reasoning_parsers import (
    REASONING_PARSERS,
    ReasoningParser,
    get_reasoning_parser,
)
from pagedserve.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedserve.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedserve.entrypoints.openai.serving_engine import OpenAIError, OpenAIServing, to_openai_error
from pagedserve.entrypoints.openai.serving_models import LoRAAdapters, parse_lora_modules
from pagedserve.entrypoints.openai.serving_pooling import OpenAIServingEmbedding, OpenAIServingScore
from pagedserve.entrypoints.openai.serving_responses import OpenAIServingResponses, ResponseStore
from pagedserve.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS,
    ToolParser,
    default_tool_parser,
    get_tool_parser,
)
from pagedserve.errors import InvalidRequestError, OverloadedError
from pagedserve.metrics import SeriesStatLogger
from pagedserve.request_limits import TEMPLATE_QUEUE_SECONDS

logger = logging.getLogger("pagedserve.api_server")
_UNION_TAG = re.compile(r"(str|int|float|bool|list\[.*\]|dict\[.*\])")
DEFAULT_MAX_REQUEST_BYTES = 16 << 20  # a 128k-token prompt as token ids is ~1 MB of JSON
DEFAULT_HTTP_READ_TIMEOUT = 30.0  # seconds for a request's headers, and again for its body
# Threads that render and tokenize requests off the event loop (their own, so that a
# queue of slow renders never holds the threads asyncio uses for anything else).
PREPARE_THREADS = 16


@dataclass
class Attachment:
    """The engine client a loaded server serves through, with what the server shows of it."""

    client: EngineClient
    max_model_len: int
    description: dict[str, Any]  # the dashboard's and /v1/models' description of the engine
    watched: AsyncLLM | None  # the one engine whose block pool the dashboard shows (none for replicas)

    @classmethod
    def local(cls, client: AsyncLLM, max_model_len: int, description: dict[str, Any] | None = None) -> Attachment:
        """An engine in this process, watched by the dashboard."""
        return cls(client, max_model_len, description or {}, client)


@dataclass
class ServerState:
    """Everything the routes need; filled in once the engine has loaded."""

    served_model_names: list[str]
    api_key: str | None = None
    metrics_without_auth: bool = False  # /metrics answers without the API key (for a scraper)
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    http_read_timeout: float | None = DEFAULT_HTTP_READ_TIMEOUT  # the body's deadline (the headers': uvicorn's protocol)
    # Host header values answered (DNS rebinding); None: any (in-process tests, or a server
    # bound to every interface).
    allowed_hosts: frozenset[str] | None = None
    draining: bool = False  # shutting down: new requests get 503
    engine: EngineClient | None = None
    completion: OpenAIServingCompletion | None = None
    chat: OpenAIServingChat | None = None
    embedding: OpenAIServingEmbedding | None = None
    score: OpenAIServingScore | None = None
    max_model_len: int = 0
    registry: Any = None
    enable_dashboard: bool = True  # the live page at / (--disable-dashboard turns it off)
    # The dashboard's per-second history: a stat logger the engine feeds from start-up.
    series: SeriesStatLogger | None = None
    dashboard: DashboardHub | None = None
    prepare_pool: ThreadPoolExecutor | None = None  # rendering and tokenizing, off the event loop
    responses_store: ResponseStore | None = None  # --enable-responses-store
    lora_adapters: LoRAAdapters = field(default_factory=LoRAAdapters)  # --lora-modules and runtime loads

    def attach(self, attachment: Attachment, tool_parser: ToolParser | None = None,
               reasoning_parser: ReasoningParser | None = None) -> None:
        engine = attachment.client
        args = (engine, self.served_model_names, attachment.max_model_len, self.lora_adapters.loras)
        self.max_model_len = attachment.max_model_len
        self.completion = OpenAIServingCompletion(*args)
        self.chat = OpenAIServingChat(*args, tool_parser=tool_parser, reasoning_parser=reasoning_parser)
        self.embedding = OpenAIServingEmbedding(*args)
        self.score = OpenAIServingScore(*args)
        if self.enable_dashboard:
            if attachment.watched is None:
                raise ValueError("the dashboard watches one engine's block pool; this client has none")
            config = {"served_model_name": self.served_model_names[0], **attachment.description}
            self.dashboard = DashboardHub(attachment.watched, self.series or SeriesStatLogger(), config)
        self.engine = engine  # last: its presence means "ready"

    def ready_for(self, runner: str, route: str) -> EngineClient:
        """ready(), and the route is one this server's runner serves (generation routes
        on the generate runner; embeddings, scores and reranking on the pooling runner)."""
        engine = self.ready()
        if engine.runner != runner:
            how = ("`pagedserve serve MODEL --runner pooling`" if runner == "pooling"
                   else "`pagedserve serve MODEL` (the generate runner)")
            raise OpenAIError(f"{route} is not served by this server, which runs the {engine.runner} runner; "
                              f"start one with {how}", param="model", code="wrong_runner")
        return engine

    def is_public(self, path: str) -> bool:
        """Routes served without the API key: /health, /metrics for a scraper when asked,
        and the dashboard page (which asks for the key itself)."""
        return (path == "/health" or (path == "/metrics" and self.metrics_without_auth)
                or (self.enable_dashboard and is_public_path(path)))

    def ready(self) -> EngineClient:
        if self.draining:
            raise OpenAIError("The server is shutting down.", status=503, type="server_error", code="shutting_down")
        if self.engine is None:
            raise OpenAIError("The model is still loading.", status=503, type="server_error")
        if self.engine.errored:
            raise OpenAIError("The engine failed and the server is shutting down.", status=503,
                              type="server_error", code="engine_dead")
        if not self.engine.serving:
            raise OpenAIError("No engine replica is serving right now (they restart on their own); retry shortly.",
                              status=503, type="server_error", code="engine_dead")
        return self.engine


def _json(model: BaseModel) -> JSONResponse:
    return JSONResponse(model.model_dump())


def build_app(state: ServerState, lifespan: Callable | None = None) -> FastAPI:
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

    if state.registry is None:
        state.registry = CollectorRegistry()
    app = FastAPI(title="pagedserve", version=pagedserve.__version__, lifespan=lifespan)
    app.state.server = state

    prepare_pool = state.prepare_pool = ThreadPoolExecutor(max_workers=PREPARE_THREADS,
                                                            thread_name_prefix="pagedserve-prepare")
    template_turn = asyncio.Semaphore(1)

    async def off_loop(fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(prepare_pool, fn, *args)

    app.add_middleware(BodyLimitMiddleware, max_bytes=state.max_request_bytes, read_timeout=state.http_read_timeout)
    app.add_middleware(APIKeyMiddleware, state=state)
    app.add_middleware(HostCheckMiddleware, state=state)  # added last: runs first

    async def _error(request: Request, exc: Exception) -> JSONResponse:
        return error_response(to_openai_error(exc), request.url.path)

    for exc_class in (OpenAIError, ValueError, EngineDeadError, OverloadedError, RequestTimeoutError,
                      EngineShutdownError, Exception):
        app.add_exception_handler(exc_class, _error)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        path = request.url.path
        errors = exc.errors()
        first = errors[0] if errors else {}
        raised = first.get("ctx", {}).get("error")
        if isinstance(raised, InvalidRequestError):  # a model validator's own refusal, with its param
            return error_response(to_openai_error(raised), path)
        if first.get("type") == "json_invalid":  # loc is ("body", character offset): not a field
            return error_response(OpenAIError(f"The request body is not valid JSON ({first.get('msg', 'invalid')} "
                                              f"at character {first.get('loc', ('', '?'))[-1]})."), path)
        # Drop "body" and pydantic's union-member tags ("str", "list[int]") from the path.
        loc = [str(x) for x in first.get("loc", ()) if x != "body" and not _UNION_TAG.fullmatch(str(x))]
        where = ".".join(loc) or "body"
        return error_response(OpenAIError(f"{where}: {first.get('msg', 'invalid request')}",
                                          param=loc[0] if loc else None), path)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(OpenAIError(str(exc.detail), status=exc.status_code,
                                          type="invalid_request_error" if exc.status_code < 500 else "server_error"),
                              request.url.path)

    if state.enable_dashboard:
        def hub() -> DashboardHub:
            state.ready()
            assert state.dashboard is not None
            return state.dashboard

        add_dashboard_routes(app, hub, SSEResponse)

    @app.get("/health")
    async def health() -> Response:
        state.ready()
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": pagedserve.__version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.registry), media_type=CONTENT_TYPE_LATEST)

    def model_card(name: str) -> ModelCard:
        base = state.served_model_names[0]
        lora = state.lora_adapters.loras.get(name)
        if lora is not None:  # (its path on the server's disk is not the client's business)
            return ModelCard(id=name, root=name, parent=lora.base_model_name or base, max_model_len=state.max_model_len)
        return ModelCard(id=name, root=base, max_model_len=state.max_model_len)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        state.ready()
        loras = list(state.lora_adapters.loras)
        return _json(ModelList(data=[model_card(name) for name in [*state.served_model_names, *loras]]))

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        """Load a PEFT adapter from the server's disk (--allow-runtime-lora-updating)."""
        engine = state.ready()
        return PlainTextResponse(await state.lora_adapters.load(engine, state.served_model_names, body.lora_name,
                                                                body.lora_path))

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        engine = state.ready()
        return PlainTextResponse(await state.lora_adapters.unload(engine, body.lora_name))

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> JSONResponse:
        """OpenAI's retrieve (`client.models.retrieve`); ids may contain slashes (org/name)."""
        state.ready()
        state.chat.model_name(model_id)  # a 404 naming it when it is not served
        return _json(model_card(model_id))

    async def generate(serving: OpenAIServing | AnthropicServingMessages | OpenAIServingResponses, body: Any,
                       request: Request) -> Response:
        """Every generation endpoint: validate and render off the event loop (templates and
        tokenizing a long prompt take seconds), let the engine accept the request (its
        refusals are 400s, before any byte is sent), then stream (SSE) or answer once.  A
        client that leaves at any point cancels it all, which aborts every engine request
        it started (a 20,000-prompt fan-out included)."""
        serving.warn_unknown_fields(body)

        async def handle() -> Response | BaseModel:
            if isinstance(body, ChatCompletionRequest) and body.chat_template:
                # Its own template renders in the one sandbox: wait for the turn here, holding
                # no thread, so a queue of slow templates never starves other requests.
                try:
                    await asyncio.wait_for(template_turn.acquire(), TEMPLATE_QUEUE_SECONDS)
                except TimeoutError:
                    raise OverloadedError("requests' own chat templates are rendered one at a time and others "
                                          "are waiting; retry shortly") from None
                try:
                    prep = await off_loop(serving.prepare, body)
                finally:
                    template_turn.release()
            else:
                prep = await off_loop(serving.prepare, body)
            request_id, streams = await serving.start(body, prep)
            if body.stream:
                return SSEResponse(serving.stream(body, prep, request_id, streams))
            return await serving.full(body, prep, request_id, streams)

        result = await cancel_on_disconnect(request, handle())
        if isinstance(result, dict):  # (the Responses API's objects are plain dicts)
            return JSONResponse(result)
        return result if isinstance(result, Response) else _json(result)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        state.ready_for("generate", "/v1/completions")
        return await generate(state.completion, body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        state.ready_for("generate", "/v1/chat/completions")
        return await generate(state.chat, body, request)

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        """OpenAI's Responses API, translated onto the chat handler (serving_responses.py)."""
        state.ready_for("generate", "/v1/responses")
        return await generate(OpenAIServingResponses(state.chat, state.responses_store), body, request)

    def stored_response(response_id: str) -> dict:
        state.ready()
        if state.responses_store is None:
            raise OpenAIError("responses are not kept on this server (start it with --enable-responses-store)",
                              status=404, param="response_id")
        found = state.responses_store.get(response_id)
        if found is None:
            raise OpenAIError(f"no stored response {response_id[:100]!r}", status=404, param="response_id")
        return found[0]

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> JSONResponse:
        return JSONResponse(stored_response(response_id))

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str) -> JSONResponse:
        stored_response(response_id)
        raise OpenAIError("only background responses can be cancelled, and this server runs none in the "
                          "background: this one has finished", param="response_id")

    @app.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request) -> Response:
        """Anthropic's Messages API, translated onto the chat handler (entrypoints/anthropic)."""
        state.ready_for("generate", "/v1/messages")
        return await generate(AnthropicServingMessages(state.chat), body, request)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest) -> dict:
        state.ready()
        return {"input_tokens": await off_loop(AnthropicServingMessages(state.chat).count_tokens, body)}

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
        state.ready_for("pooling", "/v1/embeddings")
        return await generate(state.embedding, body, request)

    async def score(body: ScoreRequest, request: Request) -> Response:
        state.ready_for("pooling", request.url.path)
        return await generate(state.score, body, request)

    async def rerank(body: RerankRequest, request: Request) -> Response:
        state.ready_for("pooling", request.url.path)
        return await generate(state.score, body, request)

    # vLLM's paths; the aliases stay out of the OpenAPI document (one entry per route).
    for i, path in enumerate(("/v1/score", "/score")):
        app.add_api_route(path, score, methods=["POST"], include_in_schema=i == 0)
    for i, path in enumerate(("/v1/rerank", "/rerank", "/v2/rerank")):
        app.add_api_route(path, rerank, methods=["POST"], include_in_schema=i == 0)

    def tokenizing(body: TokenizeRequest | DetokenizeRequest) -> OpenAIServingChat:
        """The chat handler (it holds the tokenizer), once the model named is known."""
        state.ready()
        if body.model is not None:
            state.chat.model_name(body.model)
        return state.chat

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        chat = tokenizing(body)
        if (body.prompt is None) == (body.messages is None):
            raise OpenAIError("send exactly one of prompt or messages")
        if body.messages is not None:
            ids = (await off_loop(chat.render, None, body.messages, body.add_generation_prompt)).token_ids
        else:
            ids = await off_loop(chat.tokenize, body.prompt, body.add_special_tokens)
        return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        chat = tokenizing(body)
        if len(body.tokens) > state.max_model_len:
            raise OpenAIError(f"{len(body.tokens)} tokens is more than max_model_len ({state.max_model_len})",
                              param="tokens")
        vocab = state.engine.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise OpenAIError(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", param="tokens")
        text = await off_loop(chat.tokenizer.decode, body.tokens) if chat.tokenizer is not None else ""
        return {"prompt": text}

    return app



def make_arg_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Flags of `pagedserve serve`: the server's own, then every EngineArgs flag."""
    from pagedserve.engine.arg_utils import DEFAULT_MODEL, EngineArgs

    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help=f"model to serve (same as --model; default: {DEFAULT_MODEL})")
    group = parser.add_argument_group("server arguments")
    group.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    group.add_argument("--port", type=int, default=8000, help="port to bind (default: 8000)")
    group.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on /v1/* (default: $PAGEDSERVE_API_KEY, else none)")
    group.add_argument("--served-model-name", nargs="+", default=None,
                       help="model name(s) clients use in the 'model' field (default: the MODEL argument)")
    group.add_argument("--log-stats-interval", type=float, default=10.0,
                       help="seconds between throughput log lines (default: 10)")
    group.add_argument("--disable-log-stats", action="store_true", help="no periodic throughput log line")
    group.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                       help="the format the model writes tool calls in, for tool_choice 'auto' (vLLM's names: "
                            "hermes for Qwen2.5/3, llama3_json for Llama 3.x)")
    group.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                       help="split a thinking model's <think>...</think> into reasoning_content (vLLM's names: "
                            "qwen3 for Qwen3, deepseek_r1 for DeepSeek-R1 and its distills)")
    group.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                       help="LoRA adapters (PEFT directories) served by name, as name=path or a JSON object "
                            "with name, path and base_model_name (needs --enable-lora)")
    group.add_argument("--allow-runtime-lora-updating", action="store_true",
                       help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind the API key; "
                            "vLLM: VLLM_ALLOW_RUNTIME_LORA_UPDATING)")
    group.add_argument("--enable-responses-store", action="store_true",
                       help="keep /v1/responses answers (at most 1,000 and 64 MiB, oldest out first) for "
                            "GET /v1/responses/{id} and previous_response_id (vLLM: VLLM_ENABLE_RESPONSES_API_STORE)")
    group.add_argument("--metrics-without-auth", action="store_true",
                       help="serve /metrics without the API key (for a Prometheus scraper); every other route "
                            "but /health needs it")
    group.add_argument("--max-waiting-requests", type=int, default=None,
                       help="refuse new requests with 503 and Retry-After while this many wait for a slot "
                            "(default: no limit)")
    group.add_argument("--request-timeout", type=float, default=None,
                       help="seconds a request may run; a longer one is aborted, its blocks freed, and its "
                            "client gets a 408 or an error event (default: none)")
    group.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="on SIGTERM/SIGINT, seconds running requests get to finish before they are aborted "
                            "(default: 30)")
    group.add_argument("--max-request-bytes", default=str(DEFAULT_MAX_REQUEST_BYTES),
                       help="largest request body accepted; larger ones get 413 before they are parsed "
                            "(bytes, or with a unit: 16MiB; default: 16MiB)")
    group.add_argument("--http-read-timeout", type=float, default=DEFAULT_HTTP_READ_TIMEOUT,
                       help="seconds a client has to send a request's headers (the connection is closed after) "
                            f"and then its body (408) (default: {DEFAULT_HTTP_READ_TIMEOUT:g})")
    group.add_argument("--allowed-hosts", default=None,
                       help="comma-separated names and addresses the Host header may carry, '*' for any "
                            "(default: the --host address and localhost names; any when bound to 0.0.0.0 or ::), "
                            "so that a web page cannot reach the server by DNS rebinding")
    group.add_argument("--disable-dashboard", action="store_true",
                       help="do not serve the live dashboard and chat playground at / and /dashboard")
    group.add_argument("--uvicorn-log-level", default="warning",
                       choices=["critical", "error", "warning", "info", "debug", "trace"],
                       help="uvicorn's own log level; info logs every request (default: warning)")
    EngineArgs.add_cli_args(parser)
    return parser


class _DrainingServer:
    """uvicorn's server with our signal handling: the first SIGTERM/SIGINT drains (see
    the module docstring), a second one exits at once."""

    def __init__(self, config: Any, state: ServerState, shutdown_timeout: float) -> None:
        import uvicorn

        class Server(uvicorn.Server):
            def handle_exit(inner, sig: int, frame: Any) -> None:  # noqa: N805 - uvicorn's signature
                self.on_signal(sig)

        self.server = Server(config)
        self.state = state
        self.shutdown_timeout = shutdown_timeout
        self.exit_code = 0
        self._loop: asyncio.AbstractEventLoop | None = None

    def bind_loop(self) -> None:
        self._loop = asyncio.get_running_loop()

    def on_signal(self, sig: int) -> None:
        if self.state.draining or self.server.should_exit:
            logger.warning("second signal (%s): exiting now", signal.Signals(sig).name)
            os._exit(128 + sig)
        self.state.draining = True
        logger.info("%s: draining (new requests get 503; running ones get %g s)", signal.Signals(sig).name,
                    self.shutdown_timeout)
        if self._loop is None:
            self.server.should_exit = True
        else:
            self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self.drain()))

    async def drain(self) -> None:
        engine = self.state.engine
        if engine is not None:
            engine.close_admission(EngineShutdownError("The server is shutting down and accepts no new requests."))
            deadline = time.monotonic() + self.shutdown_timeout
            while engine.num_open_requests and time.monotonic() < deadline and not engine.errored:
                await asyncio.sleep(0.05)
            if engine.num_open_requests:
                logger.warning("aborting %d requests still running after the shutdown timeout",
                               engine.num_open_requests)
                engine.abort_all(EngineShutdownError("The server shut down before this request finished."))
                await asyncio.sleep(0.2)  # the streams write their error events
        if self.state.dashboard is not None:
            self.state.dashboard.close()  # open pages' streams would hold the shutdown
        self.server.should_exit = True

    def exit_failed(self) -> None:
        """The engine died: exit non-zero once the open requests have their errors."""
        self.exit_code = 1
        self.server.should_exit = True


def run_server(args: argparse.Namespace) -> None:
    """Bind, answer 503 while the engine loads in a thread, then serve until a signal
    (drained, exit 0) or an engine failure (exit 1).  Exits with status 1 if the engine
    fails to load."""
    import uvicorn

    from pagedserve.engine.arg_utils import EngineArgs, parse_bytes
    from pagedserve.engine.data_parallel import ReplicaSet
    from pagedserve.engine.dp_client import DPAsyncLLM
    from pagedserve.engine.llm_engine import LLMEngine
    from pagedserve.metrics import RouterMetrics, StatLogger, make_prometheus_loggers, record_cache_config

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    if args.model_tag is not None and getattr(args, "model", None) not in (None, args.model_tag):
        raise SystemExit(f"error: MODEL {args.model_tag!r} and --model {args.model!r} disagree")
    try:
        engine_args = EngineArgs.from_cli_args(args, model=args.model_tag)
        max_request_bytes = parse_bytes(args.max_request_bytes, "--max-request-bytes")
        if args.shutdown_timeout < 0:
            raise ValueError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
        if not args.http_read_timeout > 0:
            raise ValueError(f"--http-read-timeout must be > 0, got {args.http_read_timeout}")
        allowed_hosts = parse_allowed_hosts(args.allowed_hosts, args.host)
        api_key = args.api_key or os.environ.get("PAGEDSERVE_API_KEY") or None  # "": no key
        if api_key is not None and not (api_key.isascii() and api_key.isprintable() and api_key.strip() == api_key):
            raise ValueError("the API key (--api-key or $PAGEDSERVE_API_KEY) must be printable ASCII without "
                             "surrounding spaces: HTTP clients send headers as ASCII, so no other key could match")
        check_front_door_limits(args.max_waiting_requests, args.request_timeout)
        names = args.served_model_name or [engine_args.model]
        if (args.lora_modules or args.allow_runtime_lora_updating) and not engine_args.enable_lora:
            raise ValueError("--lora-modules and --allow-runtime-lora-updating serve LoRA adapters: add --enable-lora")
        loras = LoRAAdapters(parse_lora_modules(args.lora_modules, names), args.allow_runtime_lora_updating)
    except (TypeError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    replicated = engine_args.data_parallel_size > 1
    if replicated and not args.disable_dashboard:
        logger.info("the dashboard shows one engine's block pool, so it is off with --data-parallel-size > 1; "
                    "/metrics has every replica's series (label engine)")
    state = ServerState(served_model_names=names, api_key=api_key,
                        metrics_without_auth=args.metrics_without_auth, max_request_bytes=max_request_bytes,
                        http_read_timeout=args.http_read_timeout, allowed_hosts=allowed_hosts,
                        enable_dashboard=not args.disable_dashboard and not replicated,
                        responses_store=ResponseStore() if args.enable_responses_store else None,
                        lora_adapters=loras)
    if state.enable_dashboard:
        state.series = SeriesStatLogger()
    failed: list[BaseException] = []
    runner: _DrainingServer | None = None

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()
        assert runner is not None
        runner.bind_loop()

        front_door = {"log_stats": not args.disable_log_stats, "log_interval": args.log_stats_interval,
                      "max_waiting_requests": args.max_waiting_requests, "request_timeout": args.request_timeout,
                      "on_dead": lambda _: runner.exit_failed()}

        def local_client(engine: LLMEngine) -> Attachment:
            stat_loggers: list[StatLogger] = [*make_prometheus_loggers(state.registry, names[0])]
            if state.series is not None:
                stat_loggers.append(state.series)
            client = AsyncLLM(engine, stat_loggers=stat_loggers, **front_door)
            description = engine.describe()
            record_cache_config(state.registry, names[0], description)
            return Attachment.local(client, engine.config.scheduler_config.max_model_len, description)

        def replicated_client(replicas: ReplicaSet) -> Attachment:
            n = replicas.num_replicas
            client = DPAsyncLLM(replicas, prometheus=make_prometheus_loggers(state.registry, names[0], n),
                                router_metrics=RouterMetrics(state.registry, names[0], n), **front_door)
            description = {**replicas.info.description, "data_parallel_size": n,
                           "router_policy": replicas.router_config.policy}
            return Attachment(client, replicas.info.max_model_len, description, None)

        def attach(build: Callable[[], Attachment]) -> None:
            attachment = build()
            client = attachment.client
            client.start()
            if args.tool_call_parser:
                parser = get_tool_parser(args.tool_call_parser)
            else:
                parser, why = default_tool_parser(client.tokenizer)
                logger.info("tool calls (tool_choice 'auto'): the %s format, since %s; --tool-call-parser "
                            "chooses another", parser.name, why)
            state.attach(attachment, parser, get_reasoning_parser(args.reasoning_parser))
            logger.info("engine ready: serving %s on http://%s:%d", ", ".join(names), args.host, args.port)

        def load() -> None:
            build: Callable[[], Attachment]
            try:
                if replicated:
                    replicas = ReplicaSet(engine_args)
                    build = lambda: replicated_client(replicas)  # noqa: E731
                else:
                    engine = LLMEngine.from_engine_args(engine_args)
                    for lora in loras.loras.values():  # a bad adapter stops the start-up, by name
                        engine.add_lora(lora)
                    build = lambda: local_client(engine)  # noqa: E731
            except BaseException as e:  # noqa: BLE001 - reported, then the server exits
                if isinstance(e, (ValueError, FileNotFoundError)):  # bad model/flags: the message says it
                    logger.error("failed to load the engine: %s", e)
                else:
                    logger.exception("failed to load the engine")
                failed.append(e)
                runner.server.should_exit = True
                return
            if not state.draining:
                loop.call_soon_threadsafe(attach, build)

        threading.Thread(target=load, name="pagedserve-load", daemon=True).start()
        yield
        if state.engine is not None:
            state.engine.shutdown()
        if state.prepare_pool is not None:
            state.prepare_pool.shutdown(wait=False, cancel_futures=True)

    app = build_app(state, lifespan=lifespan)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                            timeout_graceful_shutdown=5, http=header_timeout_protocol(args.http_read_timeout))
    runner = _DrainingServer(config, state, args.shutdown_timeout)
    logger.info("loading %s (health is 503 until ready)", engine_args.model)
    runner.server.run()
    if failed or runner.exit_code:
        raise SystemExit(1)


def main() -> None:
    parser = make_arg_parser(argparse.ArgumentParser(prog="pagedserve serve",
                                                     description="OpenAI-compatible HTTP server"))
    run_server(parser.parse_args())


if __name__ == "__main__":
    main()

"""What the HTTP routes share: `ServerState` (the flags they obey, and the serving
handlers once the engine has loaded), the threads that prepare requests off the event
loop, and the FastAPI dependencies through which every router reaches them.

One `ServerState` per app, set by `bind_state` and read by the `server_state`
dependency: routers are plain module-level `APIRouter`s with no closure over the server
they end up in, so each can be read, and tested, on its own.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Annotated, Any, TypeVar

from fastapi import Depends, FastAPI, Request, Response

from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.engine.profiler import Profiler, profiler_dir
from pagedserve.engine.protocol import EngineClient
from pagedserve.entrypoints.dashboard import DashboardHub, is_public_path
from pagedserve.entrypoints.openai.http_utils import cancel_on_disconnect
from pagedserve.entrypoints.openai.model_pool import UNSET, Lease, ModelPool, ModelSpec
from pagedserve.entrypoints.openai.protocol import RequestBody
from pagedserve.entrypoints.openai.reasoning_parsers import ReasoningParser
from pagedserve.entrypoints.openai.responses_store import ResponseStore
from pagedserve.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedserve.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedserve.entrypoints.openai.serving_engine import ModelNotFoundError, OpenAIError, ServingOptions
from pagedserve.entrypoints.openai.serving_models import LoRAAdapters
from pagedserve.entrypoints.openai.serving_pooling import OpenAIServingEmbedding, OpenAIServingScore
from pagedserve.entrypoints.openai.tool_parsers import ToolParser
from pagedserve.errors import OverloadedError, text_model_image_error
from pagedserve.lora.request import LoRARequest
from pagedserve.metrics import SeriesStatLogger
from pagedserve.model_loader.model_facts import UNKNOWN, ModelFacts, model_details
from pagedserve.model_loader.sources import local_model
from pagedserve.request_limits import PROFILE_SECONDS, TEMPLATE_QUEUE_SECONDS

DEFAULT_MAX_REQUEST_BYTES = 16 << 20  # a 128k-token prompt as token ids is ~1 MB of JSON
DEFAULT_HTTP_READ_TIMEOUT = 30.0  # seconds for a request's headers, and again for its body
# Threads that render and tokenize requests off the event loop (their own, so that a
# queue of slow renders never holds the threads asyncio uses for anything else).
PREPARE_THREADS = 16

T = TypeVar("T")


class PrepareThreads:
    """Where requests are rendered and tokenized: templates and tokenizing a long prompt
    take seconds, which on the event loop would stall every other request's stream.  A
    request's own chat template renders in the one template sandbox, so those wait for
    their turn here, holding no thread, and a queue of slow templates never starves the
    others."""

    def __init__(self, max_workers: int = PREPARE_THREADS) -> None:
        self.pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="pagedserve-prepare")
        self.template_turn = asyncio.Semaphore(1)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def run_for(self, body: RequestBody, fn: Callable[..., T], *args: Any) -> T:
        """`run` for `body`'s preparation: in the template sandbox's turn where it brings
        its own chat template (chat, /tokenize and the embeddings' chat form alike: a flood
        of slow templates on /tokenize held every thread here)."""
        return await (self.run_own_template(fn, *args) if body.brings_chat_template() else self.run(fn, *args))

    async def run_own_template(self, fn: Callable[..., T], *args: Any) -> T:
        """`run`, once the template sandbox is free (an OverloadedError, a 503, after
        TEMPLATE_QUEUE_SECONDS of waiting)."""
        try:
            await asyncio.wait_for(self.template_turn.acquire(), TEMPLATE_QUEUE_SECONDS)
        except TimeoutError:
            raise OverloadedError("requests' own chat templates are rendered one at a time and others "
                                  "are waiting; retry shortly") from None
        try:
            return await self.run(fn, *args)
        finally:
            self.template_turn.release()

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


@dataclass
class Attachment:
    """The engine client a loaded server serves through, with what the server shows of it."""

    client: EngineClient
    max_model_len: int
    description: dict[str, Any]  # the dashboard's and /v1/models' description of the engine
    watched: AsyncLLM | None  # the one engine whose block pool the dashboard shows (none for replicas)
    on_gpu: bool = False  # its weights and KV cache are in GPU memory (Ollama's size_vram)

    @classmethod
    def local(cls, client: AsyncLLM, max_model_len: int, description: dict[str, Any] | None = None) -> Attachment:
        """An engine in this process, watched by the dashboard."""
        return cls(client, max_model_len, description or {}, client)


@dataclass
class ModelHandlers:
    """One loaded model's serving handlers, over its engine: what a request for that
    model is answered by."""

    attachment: Attachment
    completion: OpenAIServingCompletion
    chat: OpenAIServingChat
    embedding: OpenAIServingEmbedding
    score: OpenAIServingScore
    dashboard: DashboardHub | None = None  # its page's live picture (each loaded model has its own)

    @property
    def engine(self) -> EngineClient:
        return self.attachment.client

    @property
    def max_model_len(self) -> int:
        return self.attachment.max_model_len

    @property
    def engine_on_gpu(self) -> bool:
        return self.attachment.on_gpu

    @property
    def kv_cache_bytes(self) -> int | None:
        """The KV cache its engines sized, every rank and replica (what the model pool
        counts against the models' memory budget); None where the description lacks it."""
        d = self.attachment.description
        try:
            per_rank = int(d["num_blocks"]) * int(d["block_size"]) * int(d["kv_bytes_per_token"])
            return per_rank * int(d.get("tensor_parallel_size", 1)) * int(d.get("data_parallel_size", 1))
        except (KeyError, TypeError, ValueError):
            return None

    async def unload(self) -> None:
        """End the model's dashboard pages (they reconnect to a loaded model), then stop
        its engine on a thread (it joins the engine thread; the memory goes with it)."""
        if self.dashboard is not None:
            self.dashboard.close()
        await asyncio.to_thread(_shutdown, weakref.ref(self.engine))

    @classmethod
    def build(cls, attachment: Attachment, names: list[str], loras: dict[str, LoRARequest],
              tool_parser: ToolParser | None = None, reasoning_parser: ReasoningParser | None = None,
              options: ServingOptions | None = None) -> ModelHandlers:
        args = (attachment.client, names, attachment.max_model_len, loras, options)
        return cls(attachment, OpenAIServingCompletion(*args),
                   OpenAIServingChat(*args, tool_parser=tool_parser, reasoning_parser=reasoning_parser),
                   OpenAIServingEmbedding(*args), OpenAIServingScore(*args))


def _shutdown(engine: weakref.ref[EngineClient]) -> None:
    """Stop an engine known by weak reference.  An executor thread's work item (its
    function and arguments) lives on until that thread next runs, which on a busy 2-core
    machine can be after the unload's garbage collection: a strong reference there kept
    a whole unloaded model (Gemma 3 270M: 500 MB) resident until the next unload, in one
    unload of five."""
    strong = engine()
    if strong is not None:
        strong.shutdown()


def check_serving(engine: EngineClient) -> None:
    """A 503 naming why when `engine` cannot take requests now."""
    if engine.errored:
        raise OpenAIError("The engine failed and the server is shutting down.", status=503,
                          type="server_error", code="engine_dead")
    if not engine.serving:
        raise OpenAIError("No engine replica is serving right now (they restart on their own); retry shortly.",
                          status=503, type="server_error", code="engine_dead")


def check_runner(served: str, wanted: str, route: str) -> None:
    """A 400 naming the flag that serves `route` where the model runs the other runner."""
    if served != wanted:
        how = ("`pagedserve serve MODEL --runner pooling`" if wanted == "pooling"
               else "`pagedserve serve MODEL` (the generate runner)")
        raise OpenAIError(f"{route} is not served by this model, which runs the {served} runner; "
                          f"start one with {how}", param="model", code="wrong_runner")


@dataclass
class CorsOptions:
    """vLLM's CORS flags: which origins, methods and headers a browser may use, and whether
    with credentials."""

    allow_origins: list[str]
    allow_methods: list[str] = field(default_factory=lambda: ["*"])
    allow_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False


@dataclass
class ServerState:
    """Everything the routes need; its models' handlers come once they have loaded."""

    served_model_names: list[str]  # the first (default) model's names
    api_key: str | None = None
    metrics_without_auth: bool = False  # /metrics answers without the API key (for a scraper)
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    http_read_timeout: float | None = DEFAULT_HTTP_READ_TIMEOUT  # the body's deadline (the headers': uvicorn's protocol)
    # Host header values answered (DNS rebinding); None: any (in-process tests, or a server
    # bound to every interface).
    allowed_hosts: frozenset[str] | None = None
    # CORS for browser clients of other origins (vLLM's --allowed-origins ...); None: none.
    cors: CorsOptions | None = None
    request_id_headers: bool = False  # --enable-request-id-headers: answers carry X-Request-Id
    log_requests: int | None = None  # --enable-log-requests: each accepted request logged, this many body characters
    draining: bool = False  # shutting down: new requests get 503
    started: bool = False  # the first model has loaded (until then every route but /health's 503 waits)
    registry: Any = None
    enable_dashboard: bool = True  # the live page at / (--disable-dashboard turns it off)
    # The first model's per-second history for the dashboard: a stat logger its engine
    # feeds from start-up (with several models, each has its own: new_series()).
    series: SeriesStatLogger | None = None
    prepare: PrepareThreads = field(default_factory=PrepareThreads)  # rendering and tokenizing, off the event loop
    responses_store: ResponseStore | None = None  # --enable-responses-store
    serving_options: ServingOptions = field(default_factory=ServingOptions)  # requests' server-wide defaults
    server_load: int | None = None  # requests at work (GET /load); None: not tracked (--enable-server-load-tracking)
    fastapi_docs: bool = True  # /docs, /redoc, /openapi.json (--disable-fastapi-docs turns them off)
    chat_template_given: bool = False  # --chat-template: every model has one, whatever its files say
    # --reasoning-parser set: thinking is split off answers (a request for it is refused
    # before its model loads without one).  None: known once loaded (in-process tests).
    splits_reasoning: bool | None = None
    lora_adapters: LoRAAdapters = field(default_factory=LoRAAdapters)  # --lora-modules and runtime loads
    # The runner every model of the pool loads with (--runner): a route of the other runner
    # is refused before its model loads.  None: known only once loaded (in-process tests).
    runner: str | None = None
    # Every servable model (model_pool.py); None: the one model served_model_names names.
    models: ModelPool[ModelHandlers] = None  # type: ignore[assignment]
    # POST /start_profile, /stop_profile (engine/profiler.py): on with $VLLM_TORCH_PROFILER_DIR.
    profiler: Profiler = field(default_factory=lambda: Profiler(profiler_dir(), max_seconds=PROFILE_SECONDS))

    def __post_init__(self) -> None:
        if self.models is None:
            first, *aliases = self.served_model_names
            self.models = ModelPool([ModelSpec(first, first, tuple(aliases))])

    def attach(self, attachment: Attachment, tool_parser: ToolParser | None = None,
               reasoning_parser: ReasoningParser | None = None) -> None:
        """The first model, loaded: the server starts answering."""
        handlers = ModelHandlers.build(attachment, self.served_model_names, self.lora_adapters.loras,
                                       tool_parser, reasoning_parser, self.serving_options)
        handlers.dashboard = self.dashboard_for(attachment, self.served_model_names[0], self.series)
        self.models.attach(self.models.default_name, handlers, handlers.kv_cache_bytes)
        self.started = True  # last: it means "ready"

    def new_series(self) -> SeriesStatLogger | None:
        """A model's per-second history for its dashboard (None: no dashboard)."""
        return SeriesStatLogger() if self.enable_dashboard else None

    def dashboard_for(self, attachment: Attachment, name: str, series: SeriesStatLogger | None) -> DashboardHub | None:
        """The dashboard's hub over one model's engine (None: no dashboard)."""
        if not self.enable_dashboard:
            return None
        if attachment.watched is None:
            raise ValueError("the dashboard watches one engine's block pool; this client has none")
        config = {"served_model_name": name, **attachment.description}
        return DashboardHub(attachment.watched, series or SeriesStatLogger(), config)

    def dashboards(self) -> list[DashboardHub]:
        return [h.dashboard for _, h in self.models.loaded() if h.dashboard is not None]

    # The first model's handlers, while it is loaded (a one-model server's, always).
    @property
    def default(self) -> ModelHandlers | None:
        return self.models.handlers(self.models.default_name)

    @property
    def engine(self) -> EngineClient | None:
        return None if self.default is None else self.default.engine

    def engines(self) -> list[EngineClient]:
        """Every loaded model's engine."""
        return [handlers.engine for _, handlers in self.models.loaded()]

    def check_up(self) -> None:
        """A 503 while the server cannot serve: shutting down, its first model still
        loading, or an engine failed."""
        if self.draining:
            raise OpenAIError("The server is shutting down.", status=503, type="server_error", code="shutting_down")
        if not self.started:
            raise OpenAIError("The model is still loading.", status=503, type="server_error")
        for engine in self.engines():
            check_serving(engine)

    def ready(self) -> EngineClient:
        """check_up(), and the first model's engine (which a one-model server keeps loaded)."""
        self.check_up()
        engine = self.engine
        if engine is None:
            raise OpenAIError(f"model {self.models.default_name!r} is not loaded right now", status=503,
                              type="server_error", code="model_loading")
        return engine

    def model_for(self, requested: str | None) -> str:
        """The pool's model a request's `model` names (a LoRA adapter's: the first model);
        a 404 naming it otherwise, and the names served (a client that used the model's
        own name after --served-model-name renamed it learns the name to use)."""
        name = self.models.resolve(requested)
        if name is None:
            if requested in self.lora_adapters.loras:
                return self.models.default_name
            names = self.models.names()
            served = ", ".join(f"`{n[:100]}`" for n in names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4
                                                                       else "")
            raise ModelNotFoundError(str(requested), f"; this server serves {served} (GET /v1/models)")
        return name

    async def lease(self, requested: str | None, runner: str | None = None, route: str = "",
                    keep_alive: Any = UNSET, chat: str | None = None,
                    client: Request | None = None, images: str | None = None) -> Lease[ModelHandlers]:
        """The request's model, loaded and held until the lease is released; a 503 while
        the server cannot serve, a 404 for a model it does not serve, on a route of the
        other runner a 400 naming the flag that serves it, and for a chat (`chat`: the
        body's field holding a conversation the model's own template must render) a 400
        naming that field before a model whose files hold no chat template is loaded (and
        the loaded one unloaded for it); alike for `images` (the body's field carrying an
        image) to a model whose files name a text model.  A `client` that leaves
        while its model loads or waits for room no longer holds it (a load nobody waits
        for unloads nothing, model_pool.py): a 499."""
        self.check_up()
        name = self.model_for(requested)
        if runner is not None and self.runner is not None:
            check_runner(self.runner, runner, route)  # (not loading a model only to refuse it)
        if chat and self.models.handlers(name) is None and not await self.has_chat_template(name):
            from pagedserve.engine.chat_utils import NO_CHAT_TEMPLATE
            from pagedserve.entrypoints.ollama.protocol import NO_CHAT_TEMPLATE_HERE, OLLAMA_PATH_PREFIX

            raise OpenAIError(f"model {name!r} {NO_CHAT_TEMPLATE_HERE}" if route.startswith(OLLAMA_PATH_PREFIX)
                              else f"model {name!r}: {NO_CHAT_TEMPLATE}", param=chat)
        if images and self.models.handlers(name) is None and not await self.takes_images(name):
            raise text_model_image_error(name, images)
        waiting = self.models.lease(name, keep_alive)
        lease = await (waiting if client is None else cancel_on_disconnect(client, waiting))
        if isinstance(lease, Response):
            raise OpenAIError("the client disconnected while its model loaded", status=499)
        try:
            engine = lease.handlers.engine
            check_serving(engine)
            if runner is not None:
                check_runner(engine.runner, runner, route)
        except BaseException:
            lease.release()
            raise
        return lease

    async def has_chat_template(self, name: str) -> bool:
        """Whether model `name` renders prompts with a chat template: --chat-template, the
        loaded model's own, else what its files hold (True where they cannot tell: one not
        fetched yet, unreadable files)."""
        handlers = self.models.handlers(name)
        if self.chat_template_given or handlers is not None:
            return self.chat_template_given or handlers.chat.engine.chat_template is not None
        info = await self._facts(name)
        return info is None or bool(info.chat_template)

    async def takes_images(self, name: str) -> bool:
        """Whether model `name`, not loaded, may take images: its files name a
        vision-language model, or cannot tell (the loaded engine refuses them then)."""
        info = await self._facts(name)
        return info is None or info.vision

    async def _facts(self, name: str) -> ModelFacts | None:
        """What the files of model `name` say of it (read off the event loop), None where
        they cannot tell."""
        path = local_model(self.models.models[name].spec.source)
        info = await asyncio.to_thread(model_details, path) if path is not None else UNKNOWN
        return None if info is UNKNOWN else info

    def is_public(self, path: str) -> bool:
        """Routes served without the API key: /health (and vLLM's /ping), /metrics for a scraper when asked,
        and the dashboard page (which asks for the key itself)."""
        return (path in ("/health", "/ping") or (path == "/metrics" and self.metrics_without_auth)
                or (self.enable_dashboard and is_public_path(path)))


def bind_state(app: FastAPI, state: ServerState) -> None:
    """Make `state` the one every route of `app` gets from `server_state`."""
    app.state.server = state


async def server_state(request: Request) -> ServerState:
    """The dependency every route takes its ServerState from (async: FastAPI would run a
    plain function on a worker thread, one hop per request for a field read)."""
    state: ServerState = request.app.state.server
    return state


ServerStateDep = Annotated[ServerState, Depends(server_state)]


async def dashboard_hub(state: ServerStateDep, model: str | None = None) -> DashboardHub:
    """The hub of the model the page names (`?model=`; else the first model, or with
    several the most recently used loaded one), once loaded: watching never loads one."""
    state.check_up()
    if model is not None:
        name = state.model_for(model)
    else:
        loaded = sorted(state.models.loaded(), key=lambda pair: -pair[0].last_used)
        name = state.models.default_name if state.models.handlers(state.models.default_name) or not loaded \
            else loaded[0][0].spec.name
    handlers = state.models.handlers(name)
    if handlers is None or handlers.dashboard is None:
        raise OpenAIError(f"model {name!r} is not loaded: the dashboard shows a loaded model's KV cache (send it a "
                          "request first)", status=503, type="server_error", code="model_loading")
    return handlers.dashboard

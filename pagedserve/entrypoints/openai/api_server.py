"""OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, /v1/responses,
/v1/models, Anthropic's /v1/messages (and count_tokens), /health, /metrics, /tokenize,
/detokenize, /version, and the dashboard at / (see entrypoints/dashboard).

Implementation: the FastAPI app factory (`build_app`, which assembles the routers of
routers/, entrypoints/anthropic and entrypoints/dashboard over one `ServerState`) and
`run_server`.  The socket is bound and /health answers 503 while the model loads in a
background thread, so orchestrators see "not ready" rather than "connection refused".

What happens under faults: if the engine loop dies, every open request gets an error
(a 503, or an error event on its stream), /health turns 503 and the process exits
with status 1 so a supervisor restarts it.  SIGTERM/SIGINT drain: new requests get
503, running ones finish until --shutdown-timeout, the rest end with an error event,
and the process exits 0; a second signal exits at once.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, FastAPI
from fastapi.middleware.cors import CORSMiddleware

import pagedserve
from pagedserve import envs
from pagedserve.engine.async_llm import (
    AsyncLLM,
    EngineShutdownError,
    check_front_door_limits,
    engine_core_client_class,
)
from pagedserve.entrypoints.anthropic.router import router as anthropic_router
from pagedserve.entrypoints.dashboard.router import dashboard_router
from pagedserve.entrypoints.ollama.router import router as ollama_router
from pagedserve.entrypoints.openai.cli_args import check_vllm_server_args, make_arg_parser, parse_args
from pagedserve.entrypoints.openai.exception_handlers import add_exception_handlers
from pagedserve.entrypoints.openai.http_utils import (
    AnthropicRequestIdMiddleware,
    APIKeyMiddleware,
    BodyLimitMiddleware,
    HostCheckMiddleware,
    HttpMetricsMiddleware,
    RequestIdHeaderMiddleware,
    ServerLoadMiddleware,
    SSEResponse,
    header_timeout_protocol,
    parse_allowed_hosts,
)
from pagedserve.entrypoints.openai.model_pool import ModelPool, ModelSpec, register_pool_metrics
from pagedserve.entrypoints.openai.model_sources import check_model_config, model_specs, pool_options
from pagedserve.entrypoints.openai.reasoning_parsers import get_reasoning_parser
from pagedserve.entrypoints.openai.responses_store import ResponseStore
from pagedserve.entrypoints.openai.routers.completions import router as completions_router
from pagedserve.entrypoints.openai.routers.lora import router as lora_router
from pagedserve.entrypoints.openai.routers.pooling import router as pooling_router
from pagedserve.entrypoints.openai.routers.responses import router as responses_router
from pagedserve.entrypoints.openai.routers.server import router as server_router
from pagedserve.entrypoints.openai.routers.tokenization import router as tokenization_router
from pagedserve.entrypoints.openai.server_state import (
    Attachment,
    CorsOptions,
    ModelHandlers,
    ServerState,
    bind_state,
    dashboard_hub,
)
from pagedserve.entrypoints.openai.serving_engine import ServingOptions
from pagedserve.entrypoints.openai.serving_models import LoRAAdapters, parse_lora_modules
from pagedserve.entrypoints.openai.tool_parsers import (
    ToolParser,
    default_tool_parser,
    get_tool_parser,
)
from pagedserve.metrics import SeriesStatLogger
from pagedserve.utils import kill_descendants, settle_start_up_heap

if TYPE_CHECKING:
    from pagedserve.engine.arg_utils import EngineArgs
    from pagedserve.engine.protocol import EngineClient

__all__ = ["Attachment", "ServerState", "build_app", "make_arg_parser", "make_engine_client", "parse_args",
           "run_server"]

logger = logging.getLogger("pagedserve.api_server")

# The API's routers, in the order their routes are matched (after the dashboard's).
API_ROUTERS: tuple[APIRouter, ...] = (server_router, lora_router, completions_router, responses_router,
                                      anthropic_router, pooling_router, tokenization_router, ollama_router)


def build_app(state: ServerState, lifespan: Callable | None = None) -> FastAPI:
    """The app over `state`: its middleware (added last runs first: the HTTP metrics, the Host check, then
    the API key, then the body limit), its error shapes, and every router."""
    from prometheus_client import CollectorRegistry

    if state.registry is None:
        state.registry = CollectorRegistry()
    docs: dict[str, Any] = {} if state.fastapi_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="pagedserve", version=pagedserve.__version__, lifespan=lifespan, **docs)
    bind_state(app, state)
    app.add_middleware(BodyLimitMiddleware, max_bytes=state.max_request_bytes, read_timeout=state.http_read_timeout)
    app.add_middleware(APIKeyMiddleware, state=state)
    if state.cors is not None:  # (before the key: a browser's preflight carries none)
        app.add_middleware(CORSMiddleware, **dataclasses.asdict(state.cors))
    if state.request_id_headers:
        app.add_middleware(RequestIdHeaderMiddleware)
    if state.server_load is not None:
        app.add_middleware(ServerLoadMiddleware, state=state)
    app.add_middleware(AnthropicRequestIdMiddleware)  # (outside the key check: its refusals carry one too)
    app.add_middleware(HostCheckMiddleware, state=state)
    app.add_middleware(HttpMetricsMiddleware, registry=state.registry)  # added last: runs first, sees every answer
    add_exception_handlers(app)
    if state.enable_dashboard:
        app.include_router(dashboard_router(dashboard_hub, SSEResponse))
    for router in API_ROUTERS:
        app.include_router(router)
    return app


def bound_url(server: Any, host: str, port: int) -> str:
    """Where a uvicorn server answers: with --port 0, the port the system chose once it is
    bound (it binds after the lifespan starts the engine's load, long before that is ready)."""
    if server.started:  # (uvicorn's `servers` exists from then on)
        for listener in server.servers:
            port = listener.sockets[0].getsockname()[1] if listener.sockets else port
    return f"{'https' if server.config.is_ssl else 'http'}://{host}:{port}"


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
            kill_descendants()  # (a local Ray's agents, the template sandbox, tensor-parallel ranks)
            os._exit(128 + sig)
        self.state.draining = True
        logger.info("%s: draining (new requests get 503; running ones get %g s)", signal.Signals(sig).name,
                    self.shutdown_timeout)
        if self._loop is None:
            self.server.should_exit = True
        else:
            self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self.drain()))

    async def drain(self) -> None:
        self.state.models.close()  # no more loads: a load under way finishes, for the requests waiting on it
        for engine in self.state.engines():
            engine.close_admission(EngineShutdownError("The server is shutting down and accepts no new requests."))
        deadline = time.monotonic() + self.shutdown_timeout

        def still_open() -> int:
            """Requests accepted before the signal: on an engine, or holding their model while
            it loads (then on no engine yet: such a request was cut after 5 s)."""
            return max(sum(e.num_open_requests for e in self.state.engines()), self.state.models.leased)

        while still_open() and time.monotonic() < deadline and not any(e.errored for e in self.state.engines()):
            await asyncio.sleep(0.05)
        if still_open():
            logger.warning("aborting %d requests still running after the shutdown timeout", still_open())
            for engine in self.state.engines():
                engine.abort_all(EngineShutdownError("The server shut down before this request finished."))
            await asyncio.sleep(0.2)  # the streams write their error events
        for hub in self.state.dashboards():
            hub.close()  # open pages' streams would hold the shutdown
        self.server.should_exit = True

    def exit_failed(self) -> None:
        """The engine died: exit non-zero once the open requests have their errors."""
        self.exit_code = 1
        self.server.should_exit = True


def _api_key(args: argparse.Namespace) -> str | None:
    if args.api_key == "":  # (`--api-key "$KEY"` with KEY unset opened the server, silently)
        raise ValueError("--api-key is empty; leave it out for a server without a key")
    from_env = envs.api_key()  # (an empty variable: no key)
    api_key, source = (args.api_key, "--api-key") if args.api_key else (from_env[1], "$" + from_env[0]) \
        if from_env else (None, "")
    if api_key is not None and not (api_key.isascii() and api_key.isprintable() and api_key.strip() == api_key):
        raise ValueError(f"the API key ({source}) must be printable ASCII without surrounding spaces: HTTP "
                         "clients send headers as ASCII, so no other key could match")
    return api_key


# A flag that only adjusts another's feature (its modifier) -> the flag that turns that feature on.
# (The engine's own, LoRA's sizes, EngineArgs warns of: for `LLM(...)` and every command.)
MODIFIER_FLAGS = {"max_log_len": "enable_log_requests", "allowed_methods": "allowed_origins",
                  "allowed_headers": "allowed_origins", "allow_credentials": "allowed_origins"}


def idle_modifiers(args: argparse.Namespace) -> list[str]:
    """A warning for each modifier set without the flag it modifies (it changes nothing:
    `--max-log-len 100` without --enable-log-requests logs no request)."""
    defaults = make_arg_parser(argparse.ArgumentParser(allow_abbrev=False))
    return [f"--{name.replace('_', '-')} has no effect without --{on.replace('_', '-')}"
            for name, on in MODIFIER_FLAGS.items()
            if getattr(args, name) != defaults.get_default(name) and not getattr(args, on)]


def _server_state(args: argparse.Namespace, engine_args: EngineArgs, specs: list[ModelSpec]) -> ServerState:
    """The server's flags, checked (a ValueError naming the flag), as the routes' state."""
    from pagedserve.utils import parse_bytes

    max_request_bytes = parse_bytes(args.max_request_bytes, "--max-request-bytes")
    if not 0 <= args.port <= 65535:  # (uvicorn refused it only after the model had loaded)
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    if not args.host:  # (an empty $HOST bound every interface, silently)
        raise ValueError("--host must not be empty (0.0.0.0 or :: binds every interface)")
    try:  # (the lookup uvicorn makes to bind: its failure was its own line, exit 3, no flag named)
        socket.getaddrinfo(args.host, args.port)
    except (socket.gaierror, UnicodeError):
        raise ValueError(f"--host {args.host!r:.100} is neither an address nor a name this machine resolves") from None
    if not args.shutdown_timeout >= 0:  # (NaN too)
        raise ValueError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    if args.enable_log_requests and args.disable_log_requests:
        raise ValueError("--enable-log-requests and --disable-log-requests contradict each other")
    if args.max_log_len < 0:
        raise ValueError(f"--max-log-len must be >= 0, got {args.max_log_len}")
    if not 0 < args.log_stats_interval < float("inf"):  # (a negative one logged at every step)
        raise ValueError(f"--log-stats-interval must be a number of seconds > 0, got {args.log_stats_interval} "
                         "(--disable-log-stats turns the line off)")
    if not args.http_read_timeout > 0:
        raise ValueError(f"--http-read-timeout must be > 0, got {args.http_read_timeout}")
    allowed_hosts = parse_allowed_hosts(args.allowed_hosts, args.host)
    check_vllm_server_args(args)
    api_key = _api_key(args)
    check_front_door_limits(args.max_waiting_requests, args.request_timeout)
    names = [specs[0].name, *specs[0].aliases]
    if (args.lora_modules or args.allow_runtime_lora_updating) and not engine_args.enable_lora:
        raise ValueError("--lora-modules and --allow-runtime-lora-updating serve LoRA adapters: add --enable-lora")
    several = len(specs) > 1
    if several and (engine_args.enable_lora or engine_args.data_parallel_size > 1):
        raise ValueError("several models per server do not combine with --enable-lora or --data-parallel-size "
                         "yet: serve one model with those")
    loras = LoRAAdapters(parse_lora_modules(args.lora_modules, names), args.allow_runtime_lora_updating)
    if args.allow_runtime_lora_updating and api_key is None:
        logger.warning("--allow-runtime-lora-updating without an API key: any client may have the server read "
                       "adapter directories from its disk (set --api-key)")
    for line in idle_modifiers(args):
        logger.warning(line)
    watchable = engine_core_client_class(engine_args).WATCHES_BLOCK_POOL
    if not watchable and not args.disable_dashboard:
        logger.info("the dashboard shows one engine's block pool, so it is off with --data-parallel-size > 1; "
                    "/metrics has every replica's series (label engine)")
    state = ServerState(served_model_names=names, api_key=api_key,
                        metrics_without_auth=args.metrics_without_auth, max_request_bytes=max_request_bytes,
                        http_read_timeout=args.http_read_timeout, allowed_hosts=allowed_hosts,
                        enable_dashboard=not args.disable_dashboard and watchable,
                        responses_store=ResponseStore() if args.enable_responses_store else None,
                        lora_adapters=loras, runner=engine_args.runner, cors=cors_options(args),
                        request_id_headers=args.enable_request_id_headers,
                        log_requests=args.max_log_len if args.enable_log_requests else None,
                        serving_options=ServingOptions(args.default_chat_template_kwargs or {},
                                                       args.enable_force_include_usage),
                        fastapi_docs=not args.disable_fastapi_docs,
                        server_load=0 if args.enable_server_load_tracking else None,
                        chat_template_given=engine_args.chat_template is not None,
                        splits_reasoning=args.reasoning_parser is not None)
    if state.enable_dashboard:
        state.series = SeriesStatLogger()
    return state


def configure(args: argparse.Namespace) -> tuple[EngineArgs, ServerState]:
    """The engine's arguments and the server's state from the command line; a bad flag
    exits with its message (status 2's usage errors are argparse's own)."""
    from pagedserve.engine.arg_utils import EngineArgs

    tags = args.model_tag or []
    if tags and getattr(args, "model", None) not in (None, tags[0]):
        raise SystemExit(f"error: MODEL {tags[0]!r} and --model {args.model!r} disagree")
    try:
        engine_args = EngineArgs.from_cli_args(args, model=tags[0] if tags else None)
        engine_args.create_engine_config(load_hf_config=False)  # (every config check, before the socket binds)
        if not tags and args.models_dir is not None:  # the directory's models alone ('' refused there)
            specs = model_specs([], args.models_dir, args.served_model_name)
            engine_args = engine_args.replace(model=specs[0].source)
        else:
            specs = model_specs([engine_args.model, *tags[1:]], args.models_dir, args.served_model_name)
        state = _server_state(args, engine_args, specs)
        kv = engine_args.kv_cache_memory_bytes
        state.models = ModelPool(specs, kv_cache_bytes=int(kv) if kv is not None else None,
                                 check=functools.partial(check_model_config, engine_args),
                                 **pool_options(args, len(specs), engine_args.device))
        return engine_args, state
    except (TypeError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None


def cors_options(args: argparse.Namespace) -> CorsOptions | None:
    """--allowed-origins and its companions (lists of strings), or None without origins."""
    if args.allowed_origins is None:
        return None
    for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
        value = getattr(args, name)
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"--{name.replace('_', '-')} must be a JSON list of strings, got {value!r:.100}")
    return CorsOptions(args.allowed_origins, args.allowed_methods, args.allowed_headers, args.allow_credentials)


def make_engine_client(engine_args: EngineArgs, state: ServerState, front_door: dict[str, Any],
                       name: str | None = None, series: SeriesStatLogger | None = None) -> Callable[[], Attachment]:
    """The one place the server builds its engine client: AsyncLLM over the
    EngineCoreClient `engine_args` ask for (async_llm.make_engine_core_client: one engine
    in this process, or --data-parallel-size replicas on Ray).  Loads the model here, on
    the loading thread, which then ends (seconds to minutes: the socket answers 503
    meanwhile); the function returned wraps it in AsyncLLM on the event loop.
    `front_door`: AsyncLLM's admission and logging options.  `name`: the model's, when
    not the first (which alone has LoRA adapters); `series`: its dashboard's history."""
    from pagedserve.engine.async_llm import make_engine_core_client
    from pagedserve.metrics import StatLogger
    from pagedserve.worker.cpu_threads import release_openmp_threads

    first = name is None or name == state.models.default_name
    name = name or state.served_model_names[0]
    client = make_engine_core_client(engine_args, own_thread=False)
    engine = client.local_engine  # --lora-modules load into an engine in this process
    for adapter, lora in state.lora_adapters.loras.items() if engine is not None and first else ():
        try:
            engine.add_lora(lora)  # a bad adapter stops the start-up, by name
        except ValueError as e:
            raise ValueError(f"--lora-modules {adapter}={lora.lora_path}: {e}") from None
        logger.info("LoRA adapter %r loaded from %s (id %d)", adapter, lora.lora_path, lora.lora_int_id)
    release_openmp_threads()  # (this thread may live on: worker/cpu_threads.py)

    def build() -> Attachment:
        client.observe(state.registry, name)
        stat_loggers: list[StatLogger] = [series] if series is not None else []
        llm = AsyncLLM(stat_loggers=stat_loggers, client=client, **front_door)
        attachment = Attachment.local(llm, client.info.max_model_len, client.describe())
        attachment.on_gpu = client.info.device == "GPU"
        return attachment

    return build


def _tool_parser(args: argparse.Namespace, client: EngineClient) -> ToolParser:
    """--tool-call-parser's, else the format the model's chat template shows."""
    if args.tool_call_parser:
        return get_tool_parser(args.tool_call_parser)
    parser, why = default_tool_parser(client.tokenizer)
    logger.info("tool calls (tool_choice 'auto'): the %s format, since %s; --tool-call-parser "
                "chooses another", parser.name, why)
    return parser


class _EngineLoader:
    """The app's lifespan: once the socket is bound, load the engine on a thread of its
    own, then attach it to the state on the event loop (the routes answer 503 until
    then); at the end, shut the engine and the prepare threads down.  A failed load
    stops the server, which then exits with status 1."""

    def __init__(self, args: argparse.Namespace, engine_args: EngineArgs, state: ServerState) -> None:
        self.args, self.engine_args, self.state = args, engine_args, state
        self.runner: _DrainingServer | None = None  # set once the app (which this serves) has its server
        self.failed: list[BaseException] = []
        self.front_door: dict[str, Any] = {}
        self.first_load: asyncio.Future[None] | None = None  # several models: the first one's load
        if len(state.models.models) > 1:  # the others load on demand (one model stays loaded, as ever)
            state.models.set_loader(self.load_model, ModelHandlers.unload, lambda handlers: handlers.kv_cache_bytes)

    @asynccontextmanager
    async def lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()
        runner = self.runner
        assert runner is not None
        runner.bind_loop()
        args = self.args
        front_door = {"log_stats": not args.disable_log_stats, "log_interval": args.log_stats_interval,
                      "max_waiting_requests": args.max_waiting_requests, "request_timeout": args.request_timeout,
                      "on_dead": lambda _: runner.exit_failed()}
        self.front_door = front_door
        if self.state.models.can_load:  # several models: the first loads through the pool, like the others
            register_pool_metrics(self.state.registry, self.state.models)
            self.first_load = asyncio.ensure_future(self.load_first(runner))
        else:
            threading.Thread(target=self.load, args=(loop, runner, front_door), name="pagedserve-load",
                             daemon=True).start()
        yield
        self.state.models.close()
        for engine in self.state.engines():
            engine.shutdown()
        self.state.prepare.shutdown()

    def load(self, loop: asyncio.AbstractEventLoop, runner: _DrainingServer, front_door: dict[str, Any]) -> None:
        try:
            build = make_engine_client(self.engine_args, self.state, front_door, series=self.state.series)
        except BaseException as e:  # noqa: BLE001 - reported, then the server exits
            if isinstance(e, (ValueError, FileNotFoundError)):  # bad model/flags: the message says it
                logger.error("failed to load the engine: %s", e)
            else:
                logger.exception("failed to load the engine")
            self.failed.append(e)
            runner.server.should_exit = True
            return
        if not self.state.draining:
            loop.call_soon_threadsafe(self.attach, build, runner)

    async def load_first(self, runner: _DrainingServer) -> None:
        """Several models: load the first (the default) at start-up, as one request
        would, then serve; the others load on their first request.  With --models-dir
        alone, the default is the directory's first model that loads: an unreadable file
        there is named and passed over (sorted first, it stopped the server)."""
        pool = self.state.models
        directory_only = not self.args.model_tag and self.args.models_dir
        for name in [m.spec.name for m in pool.models.values()] if directory_only else [pool.default_name]:
            try:
                (await pool.lease(name)).release()
            except Exception as e:  # noqa: BLE001 - reported; with no model loaded the server exits
                logger.error("failed to load the model %r: %s", name, e)
                self.failed.append(e)
                continue
            pool.default_name = name
            self.failed.clear()
            break
        if self.failed:
            runner.server.should_exit = True
            return
        self.state.started = True
        self.state.models.start()
        settle_start_up_heap()
        logger.info("ready: serving %s on %s (%s loaded; the others load on first use)",
                    ", ".join(self.state.models.names()), bound_url(runner.server, self.args.host, self.args.port),
                    self.state.models.default_name)

    def attach(self, build: Callable[[], Attachment], runner: _DrainingServer) -> None:
        attachment = build()
        client = attachment.client
        client.start()
        parser = _tool_parser(self.args, client)
        self.state.attach(attachment, parser, get_reasoning_parser(self.args.reasoning_parser))
        self.state.models.start()
        settle_start_up_heap()
        logger.info("engine ready: serving %s on %s", ", ".join(self.state.models.names()),
                    bound_url(runner.server, self.args.host, self.args.port))

    async def load_model(self, spec: ModelSpec, kv_cache_bytes: int | None) -> ModelHandlers:
        """A model of several, loaded on demand (ModelPool): its engine on a thread, then
        its AsyncLLM and handlers here.  Its KV cache takes at most its share of the budget unless
        --kv-cache-memory-bytes or PAGEDSERVE_CPU_KV_CACHE_SPACE say otherwise."""
        engine_args = self.engine_args.replace(model=spec.source)
        if kv_cache_bytes is not None and engine_args.kv_cache_memory_bytes is None and envs.cpu_kv_cache_space() is None:
            # (a ceiling: the cache still holds no more than its max_num_seqs x max_model_len can use)
            engine_args = engine_args.replace(kv_cache_memory_ceiling=kv_cache_bytes)
        series = self.state.new_series()
        build = await asyncio.to_thread(make_engine_client, engine_args, self.state, self.front_door, spec.name,
                                        series)
        attachment = build()
        attachment.client.start()
        handlers = ModelHandlers.build(attachment, [spec.name, *spec.aliases], {},
                                       _tool_parser(self.args, attachment.client),
                                       get_reasoning_parser(self.args.reasoning_parser), self.state.serving_options)
        handlers.dashboard = self.state.dashboard_for(attachment, spec.name, series)
        return handlers


def run_server(args: argparse.Namespace) -> None:
    """Bind, answer 503 while the engine loads in a thread, then serve until a signal
    (drained, exit 0) or an engine failure (exit 1).  Exits with status 1 if the engine
    fails to load."""
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    engine_args, state = configure(args)
    loader = _EngineLoader(args, engine_args, state)
    app = build_app(state, lifespan=loader.lifespan)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                            timeout_graceful_shutdown=5, http=header_timeout_protocol(args.http_read_timeout),
                            root_path=args.root_path or "", ssl_keyfile=args.ssl_keyfile,
                            ssl_certfile=args.ssl_certfile, ssl_ca_certs=args.ssl_ca_certs,
                            ssl_cert_reqs=args.ssl_cert_reqs)
    runner = loader.runner = _DrainingServer(config, state, args.shutdown_timeout)
    logger.info("loading %s (health is 503 until ready)", engine_args.model)
    runner.server.run()
    if loader.failed or runner.exit_code:
        raise SystemExit(1)


def main() -> None:
    import sys

    parser = make_arg_parser(argparse.ArgumentParser(prog="pagedserve serve", allow_abbrev=False,
                                                     description="OpenAI-compatible HTTP server"))
    run_server(parse_args(parser, sys.argv[1:]))


if __name__ == "__main__":
    main()

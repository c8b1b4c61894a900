"""EngineCoreClient: how a front end reaches engine cores (vLLM v1's name and role).

`AsyncLLM` (the server) and `LLM` (offline) both talk to engines only through this
protocol, whatever runs them:
- `InprocClient` (`engine/inproc_client.py`): one `LLMEngine` (InputProcessor + EngineCore) in this process,
  owned by one engine thread; callers reach it through a command queue.
- `RayDPClient` (`engine/dp_client.py`): data-parallel replicas on Ray, each an engine
  core with its own `InprocClient` in a Ray actor; a prefix-aware router picks one.

Admission, `max_waiting_requests`, deadlines, drain and aborting everything live once, in
`AsyncLLM`, never in a client: a client prepares a request (`prepare`: the
InputProcessor's checks here, routing there), queues it (`add_request`), and reports
outputs and failures to its `ClientSink` on the event loop.

Why a thread for the in-process engine and not `run_in_executor` per step: the engine is
not thread-safe, so one thread owns it outright, and torch releases the GIL inside its
kernels, so the event loop keeps serving HTTP while a step runs.  Outputs are
cumulative, so each request's collector keeps only the newest one: a slow consumer skips
snapshots instead of queueing them without bound.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from pagedserve.core.snapshot import KVSnapshot
from pagedserve.engine.llm_engine import BatchProgress, LLMEngine
from pagedserve.lora.request import LoRARequest
from pagedserve.metrics import LoggingStatLogger, StatLogger
from pagedserve.outputs import EngineOutput
from pagedserve.pooling_params import PoolingParams
from pagedserve.sampling_params import SamplingParams

logger = logging.getLogger("pagedserve.async_llm")
T = TypeVar("T")


def on_own_thread(fn: Callable[[], T], name: str) -> T:
    """`fn()` run on a new thread that ends when it returns (its result or exception comes back).

    Why: torch's OpenMP runtime (libgomp) keeps a pool of worker threads for each thread
    that has run a parallel region, for as long as that thread lives, and once the pools
    hold more threads than there are CPUs it has their workers sleep between regions
    instead of spinning, so every region waits for a wake-up.  Building a model runs
    parallel regions; built on the caller's thread and then stepped on the engine thread,
    SmolLM2-135M's one-request decode step took 11-12 ms instead of 8 (2 Zen 4 cores,
    AVX-512 with native bf16).  A thread that ends takes its pool with it, leaving the
    engine thread's the only one."""
    box: list[Any] = []

    def run() -> None:
        try:
            box.append((True, fn()))
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            box.append((False, e))

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join()
    ok, value = box[0]
    if not ok:
        raise value
    return value


class EngineDeadError(RuntimeError):
    """The engine loop failed; every in-flight and later request gets this."""


def engine_dead_error(error: BaseException) -> EngineDeadError:
    """What requests see of an engine failure: its kind only (the details, which may
    name files, are in the server's log); an EngineDeadError is already worded for them
    (a new one each time: one instance raised again and again would grow its traceback)."""
    if isinstance(error, EngineDeadError):
        return EngineDeadError(str(error))
    dead = EngineDeadError(f"The engine failed ({type(error).__name__}; details in the server log) and "
                           "cannot serve requests; the server is shutting down.")
    dead.__cause__ = error  # in-process callers still see what failed
    return dead


class OutputCollector:
    """Newest cumulative output (or an error) for one request; lives on the event loop."""

    __slots__ = ("item", "ready")

    def __init__(self) -> None:
        self.item: EngineOutput | BaseException | None = None
        self.ready = asyncio.Event()

    def put(self, item: EngineOutput | BaseException) -> None:
        if not isinstance(self.item, BaseException):  # an error is final
            self.item = item
        self.ready.set()

    async def get(self) -> EngineOutput:
        await self.ready.wait()
        item, self.item = self.item, None
        self.ready.clear()
        if isinstance(item, BaseException):
            raise item
        assert item is not None
        return item


@dataclass
class EngineInfo:
    """What a front end needs of the model it serves (every engine of a client has the same)."""

    tokenizer: Any
    vocab_size: int
    max_prompt_chars: int  # longer prompt text cannot fit in max_model_len tokens: refused untokenized
    sampling_defaults: dict[str, Any]  # the model's generation-config defaults for unset request fields
    structured_outputs_backend: str  # the grammar library ("guidance" or "xgrammar")
    runner: str  # "generate", or "pooling" (embeddings and scores)
    classifier_token_ids: tuple[int, int] | None  # the pooling runner's scorer tokens, if any
    max_model_len: int
    device: str  # "CPU" or "GPU", for the log line
    chat_template: str | None = None  # the model's own (None: a base model, which serves completions)
    stop_token_ids: tuple[int, ...] = ()  # the tokens that end an answer (EOS, the generation config's)
    max_logprobs: int = 20  # the most top logprobs a request may ask for (beam search asks 2 x width)


class PreparedRequest(Protocol):
    """A request a client has prepared (checked, or routed) and not yet queued."""

    request_id: str


class ClientSink(Protocol):
    """What a client reports to, on the event loop: the front end that owns the requests'
    collectors (AsyncLLM, or a replica's own loop), and the stat loggers of its engine."""

    stat_loggers: list[StatLogger]  # fed on the engine thread with every step's statistics
    log_stats: LoggingStatLogger | None  # the periodic log line (one engine's)

    def deliver(self, outputs: list[EngineOutput]) -> None: ...

    def fail(self, request_id: str, error: BaseException) -> None:
        """End one request with `error`."""

    def is_open(self, request_id: str) -> bool:
        """The request still has a reader (not closed while it was being queued)."""

    def engine_dead(self, error: BaseException) -> None:
        """The client failed for good: every open request gets the error (once)."""


class EngineCoreClient(Protocol):
    """The one way a front end reaches engine cores (see the module docstring)."""

    info: EngineInfo
    dead_error: BaseException | None  # set once the client has failed for good
    # The engine in this process, if the client has one (beam search and scoring run on
    # it, and the progress bar reads its token counters); None for replicas.
    local_engine: LLMEngine | None

    @property
    def serving(self) -> bool:
        """Can take a request now (replicas may all be restarting)."""

    @property
    def num_waiting(self) -> int:
        """Requests waiting for a slot, as the event loop sees them now."""

    def start(self, sink: ClientSink) -> None:
        """Bind to the running event loop (idempotent)."""

    async def prepare(self, request_id: str, prompt: Any, params: SamplingParams | PoolingParams, priority: int,
                      lora_request: LoRARequest | None, arrival_time: float) -> PreparedRequest:
        """Check (or route) a request off the event loop; a bad one raises ValueError.
        `arrival_time` (time.time()): when it arrived, which orders equal priorities."""

    async def add_request(self, request: PreparedRequest, final_only: bool) -> None:
        """Queue it; returns once an engine has accepted it (a refusal raises)."""

    def abort(self, request_id: str) -> None:
        """Stop a request (unknown or finished ids are ignored); any thread may call it."""

    async def add_lora(self, lora_request: LoRARequest) -> bool: ...

    async def remove_lora(self, lora_id: int) -> bool: ...

    def watch(self, listener: Callable[[KVSnapshot, float], None] | None) -> None: ...

    def observe(self, registry: Any, model_name: str) -> None:
        """Export each engine's statistics to this Prometheus registry (vLLM's names)."""

    def describe(self) -> dict[str, Any]: ...

    def encode_chat(self, messages: list[dict], chat_template: str | None = None,
                    add_generation_prompt: bool = True, **kwargs: Any) -> dict[str, Any]: ...

    def run_batch(self, prompts: list[Any], params: list[SamplingParams] | list[PoolingParams],
                  priority: list[int] | None = None, progress: BatchProgress | None = None,
                  lora_requests: list[LoRARequest | None] | None = None) -> list[Any]:
        """The offline batch: every prompt's final output, in input order."""

    def reset_prefix_cache(self) -> bool:
        """Offline: drop every cached prefix block no request holds, in every engine (True
        where each dropped them all)."""

    def shutdown(self) -> None: ...

"""AsyncLLM: the one serving front end, over an `EngineCoreClient` (engine/core_client.py).

Admission and lifetime limits live here, once, because only a serving front end needs
them (the offline API hands the engine all its prompts at once), and whatever runs the
engines (one in this process, or data-parallel replicas on Ray) a request is admitted
here alone: `max_waiting_requests` refuses new requests while that many wait for a slot
(EngineOverloadedError, an HTTP 503 with Retry-After), `request_timeout` ends a request
that runs longer (RequestTimeoutError; its blocks are freed), `close_admission` turns new
requests away while a server drains, and `abort_all` ends every open request with an
error (graceful shutdown past its deadline).  Each open request has an `OutputCollector`
here, which the client fills on the event loop; the caller reads a `RequestStream`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Protocol

from pagedserve.core.snapshot import KVSnapshot
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.engine.core_client import (
    EngineCoreClient,
    EngineDeadError,
    OutputCollector,
    engine_dead_error,
    on_own_thread,
)
from pagedserve.engine.dp_client import RayDPClient
from pagedserve.engine.inproc_client import InprocClient, InprocEngine
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.errors import OverloadedError
from pagedserve.lora.request import LoRARequest
from pagedserve.metrics import LoggingStatLogger, StatLogger
from pagedserve.outputs import DeltaCursor, EngineOutput, RequestOutput
from pagedserve.pooling_params import PoolingParams
from pagedserve.sampling_params import RequestOutputKind, SamplingParams
from pagedserve.utils import is_number

__all__ = ["AsyncLLM", "EngineDeadError", "EngineOverloadedError", "EngineShutdownError", "OutputCollector",
           "RequestStream", "RequestTimeoutError", "check_front_door_limits", "make_engine_core_client",
           "on_own_thread"]


class EngineOverloadedError(OverloadedError):
    """Too many requests are waiting for a slot; try again after `retry_after` seconds."""


class RequestTimeoutError(TimeoutError):
    """The request ran longer than the server's request timeout and was aborted."""


class EngineShutdownError(RuntimeError):
    """The server is shutting down: the request was not accepted, or it was aborted."""


def engine_core_client_class(engine_args: EngineArgs) -> type[InprocClient] | type[RayDPClient]:
    """Which client `engine_args` ask for: data-parallel replicas on Ray
    (data_parallel_size > 1), else one engine in this process.  The one place that
    chooses: the server asks it what the client can do (`WATCHES_BLOCK_POOL`) before
    anything loads."""
    return RayDPClient if engine_args.data_parallel_size > 1 else InprocClient


def make_engine_core_client(engine_args: EngineArgs, own_thread: bool = True) -> EngineCoreClient:
    """The client `engine_args` ask for, its engines loaded: data-parallel replicas on Ray
    (data_parallel_size > 1), else one LLMEngine in this process, built on a thread of
    its own (see `on_own_thread`) for a server, whose engine thread steps it, or on the
    caller's (`own_thread=False`: offline, where the caller steps it)."""
    if engine_core_client_class(engine_args) is RayDPClient:
        return RayDPClient.from_engine_args(engine_args)
    if not own_thread:
        return InprocClient(LLMEngine.from_engine_args(engine_args))
    return InprocClient(on_own_thread(lambda: LLMEngine.from_engine_args(engine_args), "pagedserve-build"))


def check_front_door_limits(max_waiting_requests: int | None, request_timeout: float | None) -> None:
    """The admission limits' one check (a server runs it on its flags before loading)."""
    for name, value in (("max_waiting_requests", max_waiting_requests), ("request_timeout", request_timeout)):
        if value is not None and (not is_number(value) or not value > 0):  # (NaN too: every request timed out)
            raise ValueError(f"{name} must be a positive number or None, got {value!r}")


class AsyncLLM:
    """The one serving front end: admission and request lifetime over an EngineCoreClient.

    Whether a request gets in (a dead engine, a closed door, `max_waiting_requests`, a
    reused id) and the deadline its stream gets are decided here, once, whatever client
    runs the engines (one in this process, or data-parallel replicas on Ray)."""

    def __init__(self, engine: InprocEngine | None = None, stat_loggers: Sequence[StatLogger] = (),
                 log_stats: bool = True, log_interval: float = 10.0, max_waiting_requests: int | None = None,
                 request_timeout: float | None = None, on_dead: Callable[[BaseException], None] | None = None,
                 *, client: EngineCoreClient | None = None) -> None:
        """Over `client`, or over `engine` (an LLMEngine in this process: an InprocClient is
        made for it).  `stat_loggers`/`log_stats`: the in-process engine's statistics (a
        data-parallel client feeds each replica's own).  `on_dead` is called on the event
        loop once the engines have failed for good (after every open request got its
        error): a server exits so a supervisor restarts it."""
        if (engine is None) == (client is None):
            raise TypeError("AsyncLLM runs over an engine or a client: pass exactly one")
        check_front_door_limits(max_waiting_requests, request_timeout)
        self.client: EngineCoreClient = client if client is not None else InprocClient(engine)  # type: ignore[arg-type]
        self.max_waiting_requests = max_waiting_requests
        self.request_timeout = request_timeout
        self._on_dead = on_dead
        self._closed: BaseException | None = None  # set by close_admission: new requests get this
        self._collectors: dict[str, OutputCollector] = {}  # open requests (event loop only)
        self._groups: dict[str, str] = {}  # open requests that are steps of a longer one -> its id (add_request)
        self._started = False
        info = self.client.info
        self.tokenizer = info.tokenizer
        self.vocab_size: int = info.vocab_size
        self.max_prompt_chars: int = info.max_prompt_chars  # longer prompt text is refused untokenized
        # The model's generation-config sampling defaults, for request fields left unset.
        self.sampling_defaults: dict[str, Any] = info.sampling_defaults
        # The grammar library constraining structured outputs ("guidance" or "xgrammar").
        self.structured_outputs_backend: str = info.structured_outputs_backend
        # What it serves: "generate", or "pooling" (embeddings and scores), and the pooling
        # runner's classifier tokens (scores from their logits instead of embeddings).
        self.runner: str = info.runner
        self.classifier_token_ids: tuple[int, int] | None = info.classifier_token_ids
        self.chat_template: str | None = info.chat_template  # None: a base model (no chat without one given)
        self.stop_token_ids: tuple[int, ...] = info.stop_token_ids  # (beam search ends beams at them)
        self.max_logprobs: int = info.max_logprobs
        self.stat_loggers: list[StatLogger] = list(stat_loggers)
        self.log_stats = LoggingStatLogger(log_interval, device=info.device) if log_stats else None
        if self.log_stats is not None:
            self.stat_loggers.append(self.log_stats)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, **kwargs: Any) -> AsyncLLM:
        """Over the client `engine_args` ask for (make_engine_core_client)."""
        return cls(client=make_engine_core_client(engine_args), **kwargs)

    # ------------------------------------------------------------------ lifecycle
    @property
    def dead_error(self) -> BaseException | None:
        return self.client.dead_error

    @property
    def errored(self) -> bool:
        return self.client.dead_error is not None

    @property
    def serving(self) -> bool:
        """Can take requests now (with replicas the answer can change back and forth)."""
        return self.client.dead_error is None and self.client.serving

    @property
    def num_waiting(self) -> int:
        return self.client.num_waiting

    @property
    def num_open_requests(self) -> int:
        """Accepted requests whose stream has not ended yet."""
        return len(self._collectors)

    def start(self) -> None:
        """Bind the client to the running event loop (idempotent)."""
        if not self._started:
            self._started = True
            self.client.start(self)

    def close_admission(self, error: BaseException) -> None:
        """From now on add_request raises `error` (shutdown: running requests go on)."""
        self._closed = error

    def abort_all(self, error: BaseException) -> None:
        """End every open request with `error` (its stream raises it) and free its blocks."""
        for request_id in list(self._collectors):
            collector = self._collectors.pop(request_id)
            collector.put(error)
            self.client.abort(request_id)

    def shutdown(self) -> None:
        """Stop the engines (their KV tiers finish queued writes)."""
        self.client.shutdown()

    def describe(self) -> dict[str, Any]:
        """The engines' configuration, for the dashboard and /v1/models."""
        return self.client.describe()

    # ------------------------------------------------------------------ client API
    async def add_request(self, request_id: str, prompt: Any, sampling_params: SamplingParams | PoolingParams,
                          priority: int = 0, final_only: bool = False,
                          lora_request: LoRARequest | None = None, admitted: bool = False,
                          group: str | None = None, deadline: float | None = None,
                          arrival_time: float | None = None) -> RequestStream:
        """Validate and queue one request; returns once an engine has accepted it, so a
        bad request raises (ValueError / InvalidRequestError) before a server has sent
        anything.  The returned stream must be read to its end or closed; with
        `final_only` it yields the finished output alone (a non-streaming response).  A
        PoolingParams request (pooling runner) yields one PoolingRequestOutput.
        `admitted`: a later prompt of one client request whose first was let in, so
        `max_waiting_requests` does not count the request's own prompts against it (a
        fan-out is let in or refused as a whole).  `group`: a step of a longer request (a
        beam search's), let in, and counted once per group against max_waiting_requests
        however many of its steps wait; `deadline` (time.monotonic()): that request's,
        instead of request_timeout from now; `arrival_time` (time.time()): that request's,
        where its place in the queue is (None: now)."""
        started = time.monotonic()  # (the timeout counts tokenizing and grammar compiling too)
        admitted = admitted or group is not None
        self._admit(request_id, admitted)
        request = await self.client.prepare(request_id, prompt, sampling_params, priority, lora_request,
                                            time.time() if arrival_time is None else arrival_time)
        self._admit(request_id, admitted)  # the door may have closed (or the id been taken) meanwhile
        collector = OutputCollector()
        self._collectors[request_id] = collector
        if group is not None:  # (before the engine counts it waiting: another admission may look meanwhile)
            self._groups[request_id] = group
        try:
            await self.client.add_request(request, final_only)
        except BaseException:
            self._collectors.pop(request_id, None)
            self._groups.pop(request_id, None)
            raise
        if deadline is None and self.request_timeout is not None:
            deadline = started + self.request_timeout
        return RequestStream(self, request_id, collector, deadline, final_only)

    def _admit(self, request_id: str, admitted: bool = False) -> None:
        """Raise what a new request gets instead of admission, if anything."""
        self.start()
        if self.client.dead_error is not None:
            raise engine_dead_error(self.client.dead_error)
        if self._closed is not None:
            raise self._closed
        limit = self.max_waiting_requests
        groups = self._groups  # (a group's steps, waiting or running, count as one waiting request)
        if limit is not None and not admitted and self.client.num_waiting - len(groups) + len(set(groups.values())) \
                >= limit:
            raise EngineOverloadedError(f"The server is overloaded: {limit} requests are already waiting "
                                        "(max_waiting_requests); retry later.")
        if request_id in self._collectors:
            raise ValueError(f"request id {request_id!r} is already in use")

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load and check an adapter between two steps; ValueError names what is wrong."""
        self.start()
        return await self.client.add_lora(lora_request)

    async def remove_lora(self, lora_id: int) -> bool:
        self.start()
        return await self.client.remove_lora(lora_id)

    async def generate(self, prompt: Any, sampling_params: SamplingParams, request_id: str,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Stream outputs until the request finishes, as `sampling_params.output_kind`
        says (vLLM's): cumulative, only what is new each time, or the final one alone.
        Closing or cancelling the iterator aborts the request (its KV blocks are freed at
        the next loop turn); invalid input raises before anything is yielded."""
        kind = sampling_params.output_kind
        stream = await self.add_request(request_id, prompt, sampling_params, priority,
                                        final_only=kind is RequestOutputKind.FINAL_ONLY)
        cursors: dict[int, DeltaCursor] = {}
        try:
            async for out in stream:
                yield out.delta(cursors) if kind is RequestOutputKind.DELTA and isinstance(out, RequestOutput) else out
        finally:
            stream.close()

    async def abort(self, request_id: str) -> None:
        collector = self._collectors.pop(request_id, None)
        self.client.abort(request_id)
        if collector is not None:
            collector.put(asyncio.CancelledError(f"request {request_id} aborted"))

    def forget(self, request_id: str, abort: bool) -> None:
        """A stream is done with its request (finished, or closed early: abort it)."""
        self._collectors.pop(request_id, None)
        self._groups.pop(request_id, None)
        if abort:
            self.client.abort(request_id)

    def watch(self, listener: Callable[[KVSnapshot, float], None] | None) -> None:
        """Call `listener(snapshot, seconds it took)` on the event loop with snapshots of
        the engine's block pool and queues (InprocClient.watch), until `watch(None)`."""
        self.start()
        self.client.watch(listener)

    def encode_chat(self, messages: list[dict], chat_template: str | None = None,
                    add_generation_prompt: bool = True, **kwargs: Any) -> dict[str, Any]:
        """Chat rendering and tokenization (read-only: safe from the event loop)."""
        return self.client.encode_chat(messages, chat_template, add_generation_prompt, **kwargs)

    # ------------------------------------------------------------------ ClientSink (event loop)
    def deliver(self, outputs: list[EngineOutput]) -> None:
        for out in outputs:
            collector = self._collectors.get(out.request_id)
            if collector is not None:
                collector.put(out)

    def fail(self, request_id: str, error: BaseException) -> None:
        collector = self._collectors.get(request_id)
        if collector is not None:
            collector.put(error)

    def is_open(self, request_id: str) -> bool:
        return request_id in self._collectors

    def engine_dead(self, error: BaseException) -> None:
        for collector in self._collectors.values():
            collector.put(engine_dead_error(error))
        if self._on_dead is not None:
            self._on_dead(error)


class StreamOwner(Protocol):
    """What a RequestStream reports to: the client that accepted its request."""

    request_timeout: float | None

    def forget(self, request_id: str, abort: bool) -> None: ...


class RequestStream:
    """The outputs of one accepted request, newest first-come (cumulative snapshots).

    Reading past the final output ends the iteration; `close()` before that, or being
    cancelled while waiting, aborts the request; so does being dropped unread.  The
    deadline is a timer, not a check at each read: a client that stops reading (a full
    socket holds the writer) would otherwise keep its request on the engine past it."""

    def __init__(self, owner: StreamOwner, request_id: str, collector: OutputCollector,
                 deadline: float | None = None, final_only: bool = False) -> None:
        """`deadline` (time.monotonic()): then the request is aborted and the stream's next
        read raises RequestTimeoutError; `final_only`: intermediate outputs are skipped."""
        self._owner = owner
        self.request_id = request_id
        self._collector = collector
        self._final_only = final_only
        self._done = False  # read to its end, or closed
        self._released = False  # the owner has forgotten the request
        self._timer: asyncio.TimerHandle | None = None
        if deadline is not None:
            self._timer = asyncio.get_running_loop().call_later(max(0.0, deadline - time.monotonic()), self._expire)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> EngineOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            out = await self._collector.get()
            while self._final_only and not out.finished:
                out = await self._collector.get()
        except BaseException:
            self.close()
            raise
        if out.finished:
            self._done = True
            self._release(abort=False)
        return out

    def _expire(self) -> None:
        """The deadline passed: abort now, and let the next read raise."""
        self._timer = None
        waiting = self._collector.item
        if isinstance(waiting, EngineOutput) and waiting.finished:
            return  # it finished in time and is only unread: the reader gets it
        if not self._released:
            self._collector.put(RequestTimeoutError(
                f"The request ran longer than the server's request timeout "
                f"({self._owner.request_timeout:g} s) and was aborted."))
            self._release(abort=True)

    def _release(self, abort: bool) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._released:
            self._released = True
            self._owner.forget(self.request_id, abort=abort)

    def close(self) -> None:
        if not self._done:
            self._done = True
            self._release(abort=True)

    def __del__(self) -> None:
        self.close()

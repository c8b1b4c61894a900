"""AsyncLLM: the synchronous LLMEngine driven from a background thread for asyncio callers.

Why a thread and not `run_in_executor` per step: the engine is not thread-safe, so one
thread owns it outright; callers talk to it only through a command queue (add / abort)
and receive outputs through `loop.call_soon_threadsafe`.  Torch releases the GIL inside
its kernels, so the event loop keeps serving HTTP while a step runs.

Outputs are cumulative, so each request keeps only the newest one: a slow consumer
skips intermediate snapshots instead of queueing them without bound.

Admission and lifetime limits live here, at the front door, because only a serving
front end needs them (the offline API hands the engine all its prompts at once):
`max_waiting_requests` refuses new requests while that many wait for a slot
(EngineOverloadedError, an HTTP 503 with Retry-After), `request_timeout` ends a request
that runs longer (RequestTimeoutError; its blocks are freed), and `abort_all` ends
every open request with an error (graceful shutdown past its deadline).
"""

from __future__ import annotations

import abc
import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from pagedserve.core.snapshot import KVSnapshot
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.engine.input_processor import EngineCoreRequest, InputProcessor
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.errors import OverloadedError
from pagedserve.lora.request import LoRARequest
from pagedserve.metrics import IterationStats, LoggingStatLogger, SchedulerStats, StatLogger
from pagedserve.outputs import EngineOutput, PoolingRequestOutput, RequestOutput
from pagedserve.platforms import is_cuda
from pagedserve.pooling_params import PoolingParams
from pagedserve.sampling_params import SamplingParams
from pagedserve.utils import is_number
from pagedserve.worker.cpu_malloc import release_freed_memory

logger = logging.getLogger("pagedserve.async_llm")
# After this long without work, the heap's free memory goes back to the kernel: steps keep
# freed activations on the heap for speed (worker/cpu_malloc.py), which an idle server
# need not hold; trimming only after a pause keeps it off a busy server's path.  The KV
# cache's integrity check runs then too (a broken invariant would give wrong answers
# quietly: the engine stops instead, with the invariant's name in the log).
IDLE_TRIM_SECONDS = 2.0
# How often a watched engine publishes a snapshot of its block pool and queues (the
# dashboard): often enough to look live, rare enough to cost nothing measurable.
SNAPSHOT_INTERVAL = 0.25
# How often an idle engine checks whether its statistics moved without a step.
IDLE_STATS_SECONDS = 1.0

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


class EngineOverloadedError(OverloadedError):
    """Too many requests are waiting for a slot; try again after `retry_after` seconds."""


class RequestTimeoutError(TimeoutError):
    """The request ran longer than the server's request timeout and was aborted."""


class EngineShutdownError(RuntimeError):
    """The server is shutting down: the request was not accepted, or it was aborted."""


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
class _ReqStats:
    """Engine-thread bookkeeping for latency metrics of one request."""

    arrival: float
    prompt_len: int = 0
    num_tokens: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None
    done: bool = False


@dataclass
class _AddRequestCommand:
    request: EngineCoreRequest  # checked and prepared by the InputProcessor, off both threads
    arrival: float
    future: asyncio.Future = field(repr=False)


@dataclass
class _CallCommand:
    """Run `fn` on the engine thread between steps; its result or error completes `future`."""

    fn: Callable[[], Any]
    future: asyncio.Future = field(repr=False)


def check_front_door_limits(max_waiting_requests: int | None, request_timeout: float | None) -> None:
    """The admission limits' one check (a server runs it on its flags before loading)."""
    for name, value in (("max_waiting_requests", max_waiting_requests), ("request_timeout", request_timeout)):
        if value is not None and (not is_number(value) or value <= 0):
            raise ValueError(f"{name} must be a positive number or None, got {value!r}")


class FrontDoor(abc.ABC):
    """Admission and request lifetime, shared by the server's two engine clients:
    AsyncLLM (one engine in this process) and DPAsyncLLM (data-parallel replicas).
    Whether a request gets in (a dead engine, a closed door, `max_waiting_requests`, a
    reused id) and the deadline its stream gets are decided here, once; how it reaches
    an engine is the subclass's."""

    def __init__(self, max_waiting_requests: int | None, request_timeout: float | None,
                 on_dead: Callable[[BaseException], None] | None) -> None:
        """`on_dead` is called on the event loop once the engine has failed for good
        (after every open request got its error): a server exits so a supervisor
        restarts it."""
        check_front_door_limits(max_waiting_requests, request_timeout)
        self.max_waiting_requests = max_waiting_requests
        self.request_timeout = request_timeout
        self._on_dead = on_dead
        self.dead_error: BaseException | None = None
        self._closed: BaseException | None = None  # set by close_admission: new requests get this
        self._collectors: dict[str, OutputCollector] = {}  # open requests (event loop only)

    @property
    @abc.abstractmethod
    def num_waiting(self) -> int:
        """Requests waiting for a slot, as the event loop sees them now."""

    @property
    def errored(self) -> bool:
        return self.dead_error is not None

    @property
    def num_open_requests(self) -> int:
        """Accepted requests whose stream has not ended yet."""
        return len(self._collectors)

    @abc.abstractmethod
    def start(self) -> None:
        """Bind to the running event loop (idempotent)."""

    @abc.abstractmethod
    def forget(self, request_id: str, abort: bool) -> None:
        """A stream is done with its request (finished, or closed early: abort it)."""

    def close_admission(self, error: BaseException) -> None:
        """From now on add_request raises `error` (shutdown: running requests go on)."""
        self._closed = error

    def _admit(self, request_id: str) -> None:
        """Raise what a new request gets instead of admission, if anything."""
        self.start()
        if self.dead_error is not None:
            raise _dead(self.dead_error)
        if self._closed is not None:
            raise self._closed
        limit = self.max_waiting_requests
        if limit is not None and self.num_waiting >= limit:
            raise EngineOverloadedError(f"The server is overloaded: {limit} requests are already waiting "
                                        "(max_waiting_requests); retry later.")
        if request_id in self._collectors:
            raise ValueError(f"request id {request_id!r} is already in use")

    def _stream(self, request_id: str, collector: OutputCollector, final_only: bool) -> RequestStream:
        """The accepted request's stream, with its deadline from now."""
        deadline = None if self.request_timeout is None else time.monotonic() + self.request_timeout
        return RequestStream(self, request_id, collector, deadline, final_only)


class AsyncLLM(FrontDoor):
    def __init__(self, engine: LLMEngine, stat_loggers: Sequence[StatLogger] = (), log_stats: bool = True,
                 log_interval: float = 10.0, max_waiting_requests: int | None = None,
                 request_timeout: float | None = None,
                 on_dead: Callable[[BaseException], None] | None = None) -> None:
        super().__init__(max_waiting_requests, request_timeout, on_dead)
        self.engine = engine
        self.input_processor: InputProcessor = engine.input_processor
        self.tokenizer = engine.tokenizer
        self.vocab_size: int = engine.vocab_size
        self.max_prompt_chars: int = engine.max_prompt_chars  # longer prompt text is refused untokenized
        # The model's generation-config sampling defaults, for request fields left unset.
        self.sampling_defaults: dict[str, Any] = engine.sampling_defaults()
        # The grammar library constraining structured outputs ("guidance" or "xgrammar").
        self.structured_outputs_backend: str = engine.structured_outputs_backend
        # What it serves: "generate", or "pooling" (embeddings and scores), and the pooling
        # runner's classifier tokens (scores from their logits instead of embeddings).
        self.runner: str = engine.runner
        self.classifier_token_ids: tuple[int, int] | None = engine.classifier_token_ids
        self.stat_loggers: list[StatLogger] = list(stat_loggers)
        device = "GPU" if is_cuda(engine.device) else engine.device.type.upper()
        self.log_stats = LoggingStatLogger(log_interval, device=device) if log_stats else None
        if self.log_stats is not None:
            self.stat_loggers.append(self.log_stats)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._req_stats: dict[str, _ReqStats] = {}  # engine thread only
        self._num_waiting = 0  # the scheduler's waiting queue after the last step (written by the engine thread)
        self._pending_adds = 0  # adds sent to the engine thread and not answered yet (event loop only)
        # The dashboard's snapshot listener (engine thread state, set through a command).
        self._watcher: Callable[[KVSnapshot, float], None] | None = None
        self._snapshot_full = True
        self._next_snapshot = 0.0
        self._last_emitted: SchedulerStats | None = None  # what the stat loggers last got (engine thread)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, **kwargs: Any) -> AsyncLLM:
        """The engine is built on a thread of its own (see `on_own_thread`), as the server's is."""
        return cls(on_own_thread(lambda: LLMEngine.from_engine_args(engine_args), "pagedserve-build"), **kwargs)

    # ------------------------------------------------------------------ lifecycle
    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead_error is None

    @property
    def serving(self) -> bool:
        """Can take requests now (the data-parallel client's answer can change back and forth)."""
        return self.dead_error is None

    @property
    def num_waiting(self) -> int:
        """The scheduler's queue after the last step, those added since, and adds not answered yet."""
        return self._num_waiting + self._pending_adds

    def abort_all(self, error: BaseException) -> None:
        """End every open request with `error` (its stream raises it) and free its blocks."""
        for request_id in list(self._collectors):
            collector = self._collectors.pop(request_id)
            collector.put(error)
            self._send(("abort", request_id))

    def start(self) -> None:
        """Bind to the running event loop and start the engine thread (idempotent)."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="pagedserve-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        """Stop the engine loop, then the engine (its KV tier finishes queued writes)."""
        self._stop = True
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)
            if self._thread.is_alive():
                return  # a step is stuck: leave the engine to the process's exit
        self.engine.shutdown()

    # ------------------------------------------------------------------ client API
    async def add_request(self, request_id: str, prompt: Any, sampling_params: SamplingParams | PoolingParams,
                          priority: int = 0, final_only: bool = False,
                          lora_request: LoRARequest | None = None) -> RequestStream:
        """Validate and queue one request; returns once the engine has accepted it, so a
        bad request raises (ValueError / InvalidRequestError) before a server has sent
        anything.  The returned stream must be read to its end or closed; with
        `final_only` it yields the finished output alone (a non-streaming response).  A
        PoolingParams request (pooling runner) yields one PoolingRequestOutput."""
        self._admit(request_id)
        request = await self._process(request_id, prompt, sampling_params, priority, lora_request)
        self._admit(request_id)  # the door may have closed (or the id been taken) meanwhile
        assert self._loop is not None
        collector = OutputCollector()
        self._collectors[request_id] = collector
        future = self._loop.create_future()
        self._send(_AddRequestCommand(request, time.monotonic(), future))
        self._pending_adds += 1
        try:
            await future
        except BaseException:
            self._collectors.pop(request_id, None)
            if not future.done():  # cancelled while queued: the engine thread skips it
                future.cancel()
            raise
        finally:
            self._pending_adds -= 1
        return self._stream(request_id, collector, final_only)

    async def _process(self, request_id: str, prompt: Any, params: SamplingParams | PoolingParams,
                       priority: int, lora_request: LoRARequest | None) -> EngineCoreRequest:
        """The InputProcessor's work, in a worker thread so that neither the event loop nor
        the engine thread waits on tokenizing or checking; a structured-output request's
        grammar is compiled (in the grammar pool) before the engine thread sees it, so a
        bad schema is refused now."""
        request = await asyncio.to_thread(self.input_processor.process, request_id, prompt, params, None,
                                          priority, lora_request)
        if request.grammar is not None:
            await asyncio.wrap_future(request.grammar)
        return request

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load and check an adapter on the engine thread, between two steps (it owns the
        engine's adapters and the executor); ValueError names what is wrong."""
        return await self._on_engine_thread(lambda: self.engine.add_lora(lora_request))

    async def remove_lora(self, lora_id: int) -> bool:
        return await self._on_engine_thread(lambda: self.engine.remove_lora(lora_id))

    async def _on_engine_thread(self, fn: Callable[[], Any]) -> Any:
        assert self._loop is not None
        future = self._loop.create_future()
        self._send(_CallCommand(fn, future))
        return await future

    async def generate(self, prompt: Any, sampling_params: SamplingParams, request_id: str,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Stream cumulative outputs until the request finishes.  Closing or cancelling
        the iterator aborts the request (its KV blocks are freed at the next loop turn);
        invalid input raises before anything is yielded."""
        stream = await self.add_request(request_id, prompt, sampling_params, priority)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    async def abort(self, request_id: str) -> None:
        collector = self._collectors.pop(request_id, None)
        self._send(("abort", request_id))
        if collector is not None:
            collector.put(asyncio.CancelledError(f"request {request_id} aborted"))

    def forget(self, request_id: str, abort: bool) -> None:
        """A stream is done with its request (finished, or closed early: abort it).  The
        abort is FIFO after the add, and the engine thread ignores ids it does not hold."""
        self._collectors.pop(request_id, None)
        if abort:
            self._send(("abort", request_id))

    def watch(self, listener: Callable[[KVSnapshot, float], None] | None) -> None:
        """Call `listener(snapshot, seconds it took)` on the event loop with a snapshot
        of the block pool and the queues every SNAPSHOT_INTERVAL seconds (the first one
        full, then only changed blocks), until `watch(None)`.  While nobody watches, the
        pool records nothing."""
        self.start()
        self._send(("watch", listener))

    def encode_chat(self, messages: list[dict], chat_template: str | None = None,
                    add_generation_prompt: bool = True, **kwargs: Any) -> dict[str, Any]:
        """The engine's chat rendering and tokenization (read-only: safe from the event loop)."""
        return self.engine.encode_chat(messages, chat_template, add_generation_prompt, **kwargs)

    def _send(self, command: Any) -> None:
        self._commands.put(command)
        self._wake.set()

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        worked = False  # stepped since the heap was last trimmed
        try:
            while not self._stop:
                did_work = self._drain_commands()
                if self.engine.has_unfinished_requests():
                    outputs = self.engine.step()
                    worked = True
                    self._num_waiting = self.engine.get_stats().num_waiting
                    self._dispatch(outputs)
                elif did_work:
                    self._record([], time.monotonic())  # aborts change running/KV usage
                else:
                    timeout = IDLE_STATS_SECONDS
                    if self.log_stats is not None:
                        timeout = min(timeout, self.log_stats.interval)
                    if worked:
                        timeout = min(timeout, IDLE_TRIM_SECONDS)
                    if self._watcher is not None:
                        timeout = min(timeout, SNAPSHOT_INTERVAL)
                    if not self._wake.wait(timeout=timeout):
                        if worked:  # a pause after work: nothing runs, nothing is lost if this fails
                            release_freed_memory()
                            self.engine.check_invariants()
                            worked = False
                        self._emit_if_changed()
                    self._wake.clear()
                if self.log_stats is not None:
                    self.log_stats.maybe_log()
                if self._watcher is not None:
                    self._publish_snapshot()
        except BaseException as e:  # noqa: BLE001 - any failure kills the engine
            logger.exception("engine loop failed; the engine is dead")
            self.dead_error = e
            self._call_soon(self._fail_all, e)
            if self._on_dead is not None:
                self._call_soon(self._on_dead, e)

    def _drain_commands(self) -> bool:
        did_work = False
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return did_work
            did_work = True
            if isinstance(cmd, _AddRequestCommand):
                self._add(cmd)
            elif isinstance(cmd, _CallCommand):
                try:
                    result = cmd.fn()
                except Exception as e:  # noqa: BLE001 - the caller's to handle
                    self._call_soon(_set_exception, cmd.future, e)
                else:
                    self._call_soon(_set_result, cmd.future, result)
            elif cmd[0] == "watch":
                self._watcher = cmd[1]
                self.engine.watch_blocks(cmd[1] is not None)
                self._snapshot_full, self._next_snapshot = True, 0.0
            elif cmd[1] in self._req_stats:  # still live in the engine
                self.engine.abort_request([cmd[1]])
                self._finish_stats(cmd[1], "abort", time.monotonic())

    def _publish_snapshot(self) -> None:
        now = time.monotonic()
        if now < self._next_snapshot:
            return
        t0 = time.perf_counter()
        snapshot = self.engine.snapshot(self._snapshot_full)
        self._snapshot_full = False
        self._next_snapshot = now + SNAPSHOT_INTERVAL
        self._call_soon(self._watcher, snapshot, time.perf_counter() - t0)

    def _add(self, cmd: _AddRequestCommand) -> None:
        if cmd.future.cancelled():
            return
        request = cmd.request
        try:
            self.engine.add_processed_request(request)
        except (ValueError, TypeError) as e:  # InvalidRequestError (a ValueError) keeps its param
            self._call_soon(_set_exception, cmd.future, e if isinstance(e, ValueError) else ValueError(str(e)))
            return
        except Exception as e:  # noqa: BLE001 - a bug reached by one request's input fails that request only
            logger.exception("adding request %s failed", request.request_id)
            self._call_soon(_set_exception, cmd.future, e)
            return
        self._req_stats[request.request_id] = _ReqStats(arrival=cmd.arrival)
        self._num_waiting += request.num_sequences  # until the next step's count replaces it
        self._call_soon(_set_result, cmd.future, None)

    def _dispatch(self, outputs: list[EngineOutput]) -> None:
        # Cumulative outputs are fresh objects each step (the engine copies its lists), so
        # the event loop may read them while this thread moves on.
        self._record(outputs, time.monotonic())
        if outputs:
            self._call_soon(self._deliver, outputs)

    def _record(self, outputs: list[EngineOutput], now: float) -> None:
        it = IterationStats()
        for out in outputs:
            rs = self._req_stats.get(out.request_id)
            if rs is None:
                continue
            if isinstance(out, PoolingRequestOutput):  # its prompt, and done
                it.num_prompt_tokens += len(out.prompt_token_ids)
                it.finished.append(("stop", now - rs.arrival))
                del self._req_stats[out.request_id]
                continue
            n = sum(len(c.token_ids) for c in out.outputs)
            if n > rs.num_tokens:
                if rs.first_token_time is None:
                    rs.first_token_time = now
                    it.num_prompt_tokens += len(out.prompt_token_ids)
                    it.time_to_first_tokens.append(now - rs.arrival)
                else:
                    it.inter_token_latencies.append(now - rs.last_token_time)
                it.num_generation_tokens += n - rs.num_tokens
                rs.num_tokens = n
                rs.last_token_time = now
            if out.finished:
                reason = out.outputs[0].finish_reason if out.outputs else "stop"
                it.finished.append((reason or "stop", now - rs.arrival))
                del self._req_stats[out.request_id]
        self._emit(it)

    def _finish_stats(self, request_id: str, reason: str, now: float) -> None:
        rs = self._req_stats.pop(request_id, None)
        if rs is not None:
            self._emit(IterationStats(finished=[(reason, now - rs.arrival)]))

    def _emit(self, it: IterationStats) -> None:
        if not self.stat_loggers:
            return
        sched = self._last_emitted = SchedulerStats.from_engine(self.engine.get_stats())
        for stat_logger in self.stat_loggers:
            stat_logger.record(sched, it)

    def _emit_if_changed(self) -> None:
        """While idle, counters can still move (the KV tier's background writes): pass them
        on when they have, so /metrics does not wait for the next request to show them."""
        if self.stat_loggers and SchedulerStats.from_engine(self.engine.get_stats()) != self._last_emitted:
            self._emit(IterationStats())

    def _call_soon(self, fn: Any, *args: Any) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # loop closed during shutdown
            pass

    # ------------------------------------------------------------------ event loop side
    def _deliver(self, outputs: list[EngineOutput]) -> None:
        for out in outputs:
            collector = self._collectors.get(out.request_id)
            if collector is not None:
                collector.put(out)

    def _fail_all(self, error: BaseException) -> None:
        for collector in self._collectors.values():
            collector.put(_dead(error))
        while True:  # pending adds that the dead thread will never answer
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, (_AddRequestCommand, _CallCommand)) and not cmd.future.done():
                cmd.future.set_exception(_dead(error))


class StreamOwner(Protocol):
    """What a RequestStream reports to: the client that accepted its request."""

    request_timeout: float | None

    def forget(self, request_id: str, abort: bool) -> None: ...


class RequestStream:
    """The outputs of one accepted request, newest first-come (cumulative snapshots).

    Reading past the final output ends the iteration; `close()` before that, or being
    cancelled while waiting, aborts the request; so does being dropped unread."""

    def __init__(self, owner: StreamOwner, request_id: str, collector: OutputCollector,
                 deadline: float | None = None, final_only: bool = False) -> None:
        """`deadline` (time.monotonic()): past it the stream raises RequestTimeoutError;
        `final_only`: intermediate outputs are skipped."""
        self._owner = owner
        self.request_id = request_id
        self._collector = collector
        self._deadline = deadline
        self._final_only = final_only
        self._done = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> EngineOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            out = await self._next()
            while self._final_only and not out.finished:
                out = await self._next()
        except BaseException:
            self.close()
            raise
        if out.finished:
            self._done = True
            self._owner.forget(self.request_id, abort=False)
        return out

    async def _next(self) -> EngineOutput:
        if self._deadline is None:
            return await self._collector.get()
        try:
            return await asyncio.wait_for(self._collector.get(), max(0.0, self._deadline - time.monotonic()))
        except asyncio.TimeoutError:
            raise RequestTimeoutError(
                f"The request ran longer than the server's request timeout "
                f"({self._owner.request_timeout:g} s) and was aborted.") from None

    def close(self) -> None:
        if not self._done:
            self._done = True
            self._owner.forget(self.request_id, abort=True)

    def __del__(self) -> None:
        self.close()


def _dead(error: BaseException) -> EngineDeadError:
    """What requests see of an engine failure: its kind only (the details, which may
    name files, are in the server's log); an EngineDeadError is already worded for them
    (a new one each time: one instance raised again and again would grow its traceback)."""
    if isinstance(error, EngineDeadError):
        return EngineDeadError(str(error))
    dead = EngineDeadError(f"The engine failed ({type(error).__name__}; details in the server log) and "
                           "cannot serve requests; the server is shutting down.")
    dead.__cause__ = error  # in-process callers still see what failed
    return dead


def _set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)


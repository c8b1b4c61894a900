"""InprocClient: the EngineCoreClient of one `LLMEngine` in this process.

One engine thread owns the engine outright (it is not thread-safe): callers reach it
through a command queue (add, abort, watch, calls such as loading an adapter), and it
hands outputs to the client's sink through `loop.call_soon_threadsafe`.  Torch releases
the GIL inside its kernels, so the event loop keeps serving HTTP while a step runs.  The
InputProcessor's work (tokenizing, checking, compiling a grammar) runs in a worker
thread before a request reaches the engine thread, so neither thread waits on it.  The
engine thread also keeps each request's latency bookkeeping and feeds the stat loggers.
Offline, the same client runs `LLMEngine.run_batch` on the caller's thread instead.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from pagedserve.core.snapshot import KVSnapshot
from pagedserve.engine.core_client import ClientSink, EngineInfo, engine_dead_error
from pagedserve.engine.input_processor import EngineCoreRequest
from pagedserve.engine.llm_engine import BatchProgress, LLMEngine
from pagedserve.lora.request import LoRARequest
from pagedserve.metrics import (
    FinishedRequestStats,
    IterationStats,
    LoggingStatLogger,
    SchedulerStats,
    StatLogger,
    make_prometheus_loggers,
    record_cache_config,
)
from pagedserve.outputs import EngineOutput, PoolingRequestOutput
from pagedserve.platforms import is_cuda
from pagedserve.pooling_params import PoolingParams
from pagedserve.sampling_params import SamplingParams
from pagedserve.worker.cpu_malloc import release_freed_memory, take_freed_memory_note
from pagedserve.worker.cpu_threads import release_openmp_threads

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


class InputProcessing(Protocol):
    def process(self, request_id: str, prompt: Any, params: SamplingParams | PoolingParams | None = None,
                arrival_time: float | None = None, priority: int = 0,
                lora_request: LoRARequest | None = None) -> EngineCoreRequest: ...


class InprocEngine(Protocol):
    """What InprocClient needs of its engine: an `LLMEngine` (tests: a fake with its surface)."""

    tokenizer: Any
    vocab_size: int
    max_prompt_chars: int
    max_model_len: int
    structured_outputs_backend: str
    runner: str
    classifier_token_ids: tuple[int, int] | None
    input_processor: InputProcessing
    chat_template: str | None
    stop_token_ids: list[int]
    max_logprobs: int

    @property
    def device(self) -> Any: ...

    def sampling_defaults(self) -> dict[str, Any]: ...

    def add_processed_request(self, request: EngineCoreRequest) -> None: ...

    def abort_request(self, request_ids: list[str]) -> None: ...

    def has_unfinished_requests(self) -> bool: ...

    def step(self) -> list[EngineOutput]: ...

    def get_stats(self) -> Any: ...

    def get_num_waiting(self) -> int: ...

    def check_invariants(self) -> None: ...

    def check_health(self) -> None: ...

    def watch_blocks(self, enabled: bool) -> None: ...

    def snapshot(self, full: bool) -> KVSnapshot: ...

    def add_lora(self, lora_request: LoRARequest) -> bool: ...

    def remove_lora(self, lora_id: int) -> bool: ...

    def describe(self) -> dict[str, Any]: ...

    def encode_chat(self, messages: list[dict], chat_template: str | None = None,
                    add_generation_prompt: bool = True, **kwargs: Any) -> dict[str, Any]: ...

    def run_batch(self, prompts: list[Any], params: list[Any], priority: list[int] | None = None,
                  progress: BatchProgress | None = None,
                  lora_requests: list[LoRARequest | None] | None = None) -> list[Any]: ...

    def reset_prefix_cache(self) -> bool: ...

    def shutdown(self) -> None: ...


@dataclass
class _ReqStats:
    """Engine-thread bookkeeping for latency metrics of one request."""

    arrival: float
    n: int = 1
    max_tokens: int | None = None
    num_tokens: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None


@dataclass
class _AddRequestCommand:
    request: EngineCoreRequest
    arrival: float
    future: asyncio.Future = field(repr=False)


@dataclass
class _CallCommand:
    """Run `fn` on the engine thread between steps; its result or error completes `future`."""

    fn: Callable[[], Any]
    future: asyncio.Future = field(repr=False)


@dataclass
class _AbortCommand:
    request_id: str


@dataclass
class _WatchCommand:
    listener: Callable[[KVSnapshot, float], None] | None


class InprocClient:
    """One engine in this process, stepped by the engine thread it owns (module docstring)."""

    WATCHES_BLOCK_POOL = True  # `watch` sends snapshots of its one block pool (the dashboard)

    def __init__(self, engine: InprocEngine) -> None:
        self.engine = engine
        self.local_engine = engine if isinstance(engine, LLMEngine) else None
        self.info = EngineInfo(
            engine.tokenizer, engine.vocab_size, engine.max_prompt_chars, engine.sampling_defaults(),
            engine.structured_outputs_backend, engine.runner, engine.classifier_token_ids, engine.max_model_len,
            "GPU" if is_cuda(engine.device) else engine.device.type.upper(), engine.chat_template,
            tuple(engine.stop_token_ids), engine.max_logprobs)
        self.dead_error: BaseException | None = None
        self._sink: ClientSink | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._req_stats: dict[str, _ReqStats] = {}  # engine thread only
        self._num_waiting = 0  # the scheduler's waiting queue after the last step (written by the engine thread)
        # Adds sent to the engine thread (by the event loop) and taken by it (by the engine
        # thread, after counting them into _num_waiting): their difference, the adds on the
        # way.  (A count of adds not yet answered, kept on the event loop, counted each add
        # twice until its answer got there: a burst of 4 looked like 8 waiting.)
        self._adds_sent = 0
        self._adds_taken = 0
        # The dashboard's snapshot listener (engine thread state, set through a command).
        self._watcher: Callable[[KVSnapshot, float], None] | None = None
        self._snapshot_full = True
        self._next_snapshot = 0.0
        self._last_emitted: SchedulerStats | None = None  # what the stat loggers last got (engine thread)
        self._exporters: list[StatLogger] = []  # Prometheus (observe), beside the sink's stat loggers

    # ------------------------------------------------------------------ event loop side
    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead_error is None

    @property
    def serving(self) -> bool:
        return self.dead_error is None

    @property
    def num_waiting(self) -> int:
        """The scheduler's queue after the last step, those added since, and adds on the way."""
        return self._num_waiting + self._adds_sent - self._adds_taken

    def start(self, sink: ClientSink) -> None:
        """Bind to the running event loop and start the engine thread (idempotent)."""
        if self._thread is not None:
            return
        self._sink = sink
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

    async def prepare(self, request_id: str, prompt: Any, params: SamplingParams | PoolingParams, priority: int,
                      lora_request: LoRARequest | None, arrival_time: float) -> EngineCoreRequest:
        """The InputProcessor's work, in a worker thread so that neither the event loop nor
        the engine thread waits on tokenizing or checking; a structured-output request's
        grammar is compiled (in the grammar pool) before the engine thread sees it, so a
        bad schema is refused now."""
        request = await asyncio.to_thread(self.engine.input_processor.process, request_id, prompt, params,
                                          arrival_time, priority, lora_request)
        if request.grammar is not None:
            # Shielded: a client that leaves cancels its own wait, never the compile that
            # every request with this spec shares (StructuredOutputManager caches it).
            await asyncio.shield(asyncio.wrap_future(request.grammar))
        return request

    async def add_request(self, request: EngineCoreRequest, final_only: bool = False) -> None:
        """Hand a prepared request to the engine thread; returns once the engine has taken
        it (its refusals, such as an id in use or a prompt the KV cache cannot hold, raise here)."""
        assert self._loop is not None
        future = self._loop.create_future()
        self._adds_sent += 1
        self._send(_AddRequestCommand(request, time.monotonic(), future))
        try:
            await future
        except BaseException as e:
            if not future.done():  # cancelled while queued: the engine thread skips it
                future.cancel()
            if isinstance(e, asyncio.CancelledError):
                # The engine thread may have taken it just before (its answer queued, not yet
                # set): aborted, FIFO after the add, or it ran to max_tokens with no client.
                self.abort(request.request_id)
            raise

    def abort(self, request_id: str) -> None:
        """FIFO after the add; the engine thread ignores ids it does not hold."""
        self._send(_AbortCommand(request_id))

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

    def watch(self, listener: Callable[[KVSnapshot, float], None] | None) -> None:
        """Call `listener(snapshot, seconds it took)` on the event loop with a snapshot
        of the block pool and the queues every SNAPSHOT_INTERVAL seconds (the first one
        full, then only changed blocks), until `watch(None)`.  While nobody watches, the
        pool records nothing."""
        self._send(_WatchCommand(listener))

    def observe(self, registry: Any, model_name: str) -> None:
        """The engine's series (label engine="0") and its cache config, on /metrics."""
        self._exporters = make_prometheus_loggers(registry, model_name)
        record_cache_config(registry, model_name, self.describe())

    def describe(self) -> dict[str, Any]:
        return self.engine.describe()

    def encode_chat(self, messages: list[dict], chat_template: str | None = None,
                    add_generation_prompt: bool = True, **kwargs: Any) -> dict[str, Any]:
        """The engine's chat rendering and tokenization (read-only: safe from the event loop)."""
        return self.engine.encode_chat(messages, chat_template, add_generation_prompt, **kwargs)

    def run_batch(self, prompts: list[Any], params: list[SamplingParams] | list[PoolingParams],
                  priority: list[int] | None = None, progress: BatchProgress | None = None,
                  lora_requests: list[LoRARequest | None] | None = None) -> list[Any]:
        """The offline batch, on the caller's thread (an offline client never starts the
        engine thread): `LLMEngine.run_batch`."""
        assert self._thread is None, "the engine thread owns this engine"
        return self.engine.run_batch(prompts, params, priority, progress, lora_requests)

    def reset_prefix_cache(self) -> bool:
        assert self._thread is None, "the engine thread owns this engine"
        return self.engine.reset_prefix_cache()

    def _send(self, command: Any) -> None:
        self._commands.put(command)
        self._wake.set()

    def _fail_pending(self, error: BaseException) -> None:
        """Adds and calls the dead thread will never answer (on the event loop)."""
        assert self._sink is not None
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, (_AddRequestCommand, _CallCommand)) and not cmd.future.done():
                cmd.future.set_exception(engine_dead_error(error))
        self._sink.engine_dead(error)

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        try:
            self._loop_until_stopped()
        except BaseException as e:  # noqa: BLE001 - any failure kills the engine
            logger.exception("engine loop failed; the engine is dead")
            self.dead_error = e
            self._call_soon(self._fail_pending, e)

    def _loop_until_stopped(self) -> None:
        assert self._sink is not None
        log_stats = self._sink.log_stats
        worked = False  # stepped since the heap was last trimmed
        while not self._stop:
            did_work = self._drain_commands()
            worked = worked or did_work  # (a command's work, an adapter's load, is work too)
            if did_work:  # adds and aborts move the queue: its count, not the adds' running sum
                self._num_waiting = self.engine.get_num_waiting()
            if self.engine.has_unfinished_requests():
                outputs = self.engine.step()
                worked = True
                self._num_waiting = self.engine.get_num_waiting()
                self._dispatch(outputs)
            elif did_work:
                self._record([], time.monotonic())  # aborts change running/KV usage
            else:
                worked = self._idle(worked, log_stats)
            if log_stats is not None:
                log_stats.maybe_log()
            if self._watcher is not None:
                self._publish_snapshot()

    def _idle(self, worked: bool, log_stats: LoggingStatLogger | None) -> bool:
        """Wait for a command; after a pause following work, trim the heap and check the
        KV cache (trim it too after memory freed outside the steps).  Returns whether
        work is still untrimmed."""
        timeout = IDLE_STATS_SECONDS
        if log_stats is not None:
            timeout = min(timeout, log_stats.interval)
        if worked:
            timeout = min(timeout, IDLE_TRIM_SECONDS)
        if self._watcher is not None:
            timeout = min(timeout, SNAPSHOT_INTERVAL)
        woken = self._wake.wait(timeout=timeout)
        # A tensor-parallel worker may die while nothing runs: the engine is dead now, not
        # at the next request's step (the server answered /health 200 until then).
        self.engine.check_health()
        if not woken:
            # A pause after work, or after intake freed memory (a prompt's decoded images,
            # cpu_malloc.note_freed_memory): nothing runs, nothing is lost if this fails.
            if take_freed_memory_note() or worked:
                release_freed_memory()
            if worked:
                self.engine.check_invariants()
                # An idle engine's OpenMP workers would slow a busy one's (another model
                # behind the same server): worker/cpu_threads.py.
                release_openmp_threads()
                worked = False
            self._emit_if_changed()
        self._wake.clear()
        return worked

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
            elif isinstance(cmd, _WatchCommand):
                self._watcher = cmd.listener
                self.engine.watch_blocks(cmd.listener is not None)
                self._snapshot_full, self._next_snapshot = True, 0.0
            elif cmd.request_id in self._req_stats:  # still live in the engine
                self.engine.abort_request([cmd.request_id])
                self._finish_stats(cmd.request_id, "abort", time.monotonic())

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
        try:
            self._take(cmd)
        finally:
            self._adds_taken += 1  # (after _num_waiting counts it: never a moment counted nowhere)

    def _take(self, cmd: _AddRequestCommand) -> None:
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
        params = request.sampling_params
        max_tokens = params.max_tokens  # (unset: what the context leaves, vLLM's figure for the histogram)
        if max_tokens is None:
            max_tokens = self.engine.max_model_len - len(request.prompt_token_ids)
        self._req_stats[request.request_id] = _ReqStats(
            arrival=cmd.arrival, n=request.num_sequences,
            max_tokens=max_tokens if request.pooling_params is None else None)
        self._num_waiting += request.num_sequences  # until the next step's count replaces it
        self._call_soon(_set_result, cmd.future, None)

    def _dispatch(self, outputs: list[EngineOutput]) -> None:
        # Cumulative outputs are fresh objects each step (the engine copies its lists), so
        # the event loop may read them while this thread moves on.
        self._record(outputs, time.monotonic())
        if outputs:
            assert self._sink is not None
            self._call_soon(self._sink.deliver, outputs)

    def _record(self, outputs: list[EngineOutput], now: float) -> None:
        it = IterationStats()
        for out in outputs:
            rs = self._req_stats.get(out.request_id)
            if rs is not None and _record_one(it, rs, out, now):
                del self._req_stats[out.request_id]
        if it.num_prompt_tokens or it.num_generation_tokens:
            it.step_tokens.append(it.num_prompt_tokens + it.num_generation_tokens)
        self._emit(it)

    def _finish_stats(self, request_id: str, reason: str, now: float) -> None:
        rs = self._req_stats.pop(request_id, None)
        if rs is not None:
            self._emit(IterationStats(finished=[(reason, now - rs.arrival)]))

    def _emit(self, it: IterationStats) -> None:
        assert self._sink is not None
        if not (self._exporters or self._sink.stat_loggers):
            return
        sched = self._last_emitted = SchedulerStats.from_engine(self.engine.get_stats())
        for stat_logger in [*self._exporters, *self._sink.stat_loggers]:
            stat_logger.record(sched, it)

    def _emit_if_changed(self) -> None:
        """While idle, counters can still move (the KV tier's background writes): pass them
        on when they have, so /metrics does not wait for the next request to show them."""
        assert self._sink is not None
        if (self._exporters or self._sink.stat_loggers) and SchedulerStats.from_engine(self.engine.get_stats()) != self._last_emitted:
            self._emit(IterationStats())

    def _call_soon(self, fn: Any, *args: Any) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # loop closed during shutdown
            pass


def _record_one(it: IterationStats, rs: _ReqStats, out: EngineOutput, now: float) -> bool:
    """Add one request's output to the step's statistics; True once it has finished."""
    if isinstance(out, PoolingRequestOutput):  # its prompt, and done
        it.num_prompt_tokens += len(out.prompt_token_ids)
        it.finished.append(("stop", now - rs.arrival))
        it.finished_requests.append(_finished_request(rs, out, []))
        return True
    n = sum(len(c.token_ids) for c in out.outputs)
    if n > rs.num_tokens:
        if rs.first_token_time is None:
            rs.first_token_time = now
            it.num_prompt_tokens += len(out.prompt_token_ids)
            it.time_to_first_tokens.append(now - rs.arrival)
        else:
            assert rs.last_token_time is not None
            it.inter_token_latencies.append(now - rs.last_token_time)
        it.num_generation_tokens += n - rs.num_tokens
        rs.num_tokens = n
        rs.last_token_time = now
    if out.finished:
        reason = out.outputs[0].finish_reason if out.outputs else "stop"
        it.finished.append((reason or "stop", now - rs.arrival))
        it.finished_requests.append(_finished_request(rs, out, [len(c.token_ids) for c in out.outputs]))
        return True
    return False


def _finished_request(rs: _ReqStats, out: EngineOutput, lengths: list[int]) -> FinishedRequestStats:
    """vLLM's per-request figures of a request that finished with an answer; its phases
    from the engine's timestamps (RequestMetrics), each 0 where a phase did not happen."""
    m = out.metrics

    def span(start: float | None, end: float | None) -> float:
        return max(0.0, end - start) if start is not None and end is not None else 0.0

    first_step, first_token, last_token = ((m.first_scheduled_time, m.first_token_time, m.last_token_time)
                                           if m is not None else (None, None, None))
    prefill, decode = span(first_step, first_token), span(first_token, last_token)
    return FinishedRequestStats(
        prompt_tokens=len(out.prompt_token_ids), generation_tokens=sum(lengths),
        max_generation_tokens=max(lengths, default=0), n=rs.n, max_tokens=rs.max_tokens,
        queue_seconds=span(m.arrival_time if m is not None else None, first_step),
        prefill_seconds=prefill, decode_seconds=decode, inference_seconds=prefill + decode)


def _set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)

"""RayDPClient: an EngineCoreClient over data-parallel replicas on Ray
(`engine/data_parallel.py`: each replica is an engine core in a Ray actor).

`AsyncLLM` runs over it as over the in-process client, so admission, limits, deadlines,
drain and abort exist once, in `AsyncLLM`.  It runs on the event loop, with no thread of
its own:
- each request goes to the replica `engine/router.py` picks; the replica's async
  generator first answers "accepted" or a refusal (so a bad request is a 400 before any
  byte is sent), then streams outputs (non-streaming requests: the final one only);
- a monitor task polls every replica every STATS_INTERVAL for its statistics (which feed
  the router's loads, `/metrics` under an `engine` label, and one log line per replica)
  and marks a replica down when a poll fails or goes unanswered for HEALTH_TIMEOUT, and
  up again when one succeeds (a new boot id: it restarted, so its index is reset);
- a request whose replica fails before the client has received anything from it is sent
  once more to another replica (a non-streaming request receives nothing until it is
  finished, so it is always retried once); a stream that had already sent tokens ends
  with an error, since its text cannot be taken back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagedserve.core.snapshot import KVSnapshot
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.engine.core_client import ClientSink, EngineDeadError, EngineInfo
from pagedserve.engine.data_parallel import ReplicaRefusal, ReplicaReport, ReplicaSet, routing_tokens
from pagedserve.engine.llm_engine import BatchProgress, LLMEngine
from pagedserve.engine.router import NoReplicaError, Router
from pagedserve.errors import InvalidRequestError
from pagedserve.lora.request import LoRARequest
from pagedserve.metrics import (
    LoggingStatLogger,
    PrometheusStatLogger,
    RouterMetrics,
    make_prometheus_loggers,
    record_cache_config,
)
from pagedserve.outputs import RequestOutput
from pagedserve.pooling_params import PoolingParams
from pagedserve.sampling_params import SamplingParams

_NO_LORA = "LoRA adapters do not run on data-parallel replicas (yet): serve them with --data-parallel-size 1"

logger = logging.getLogger("pagedserve.dp_client")

STATS_INTERVAL = 0.1  # seconds between polls of each replica (loads, metrics, health)
HEALTH_TIMEOUT = 5.0  # a poll unanswered this long marks its replica down
# A replica down this long is given up on; when all are, the client is dead (the server exits).
REPLICA_DEAD_SECONDS = 600.0


@dataclass
class _Request:
    """What is sent again when a request moves to another replica."""

    request_id: str
    args: tuple  # EngineReplica.generate's arguments
    hashes: list[int]  # the prompt's block hashes, for the router
    num_tokens: int


@dataclass
class _Flight:
    """One request in flight: where it runs and the task pumping its outputs."""

    replica: int
    attempts: int  # times it moved to another replica after one failed
    counted: bool = True  # in its replica's load (router.dispatched, not yet router.ended)
    task: asyncio.Task | None = field(default=None, repr=False)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class RayDPClient:
    """An EngineCoreClient over data-parallel replicas (see the module docstring)."""

    # The dashboard draws one engine's block pool; replicas each have their own.
    WATCHES_BLOCK_POOL = False

    def __init__(self, replicas: ReplicaSet) -> None:
        self.replicas = replicas
        self.num_replicas = n = replicas.num_replicas
        info = replicas.info
        self.info = EngineInfo(info.tokenizer, info.vocab_size, info.max_prompt_chars, info.sampling_defaults,
                               info.structured_outputs_backend, "generate",  # EngineArgs refuses pooling with replicas
                               None, info.max_model_len, info.device, info.chat_template, info.stop_token_ids,
                               info.max_logprobs)
        self.dead_error: BaseException | None = None
        self.local_engine: LLMEngine | None = None  # every engine is in a replica
        self.router = Router(replicas.router_config, n, info.block_size, info.num_blocks)
        self.metrics: RouterMetrics | None = None
        self.prometheus: list[PrometheusStatLogger] = []
        self.log_stats: list[LoggingStatLogger] = []
        self._sink: ClientSink | None = None
        self._flights: dict[str, _Flight] = {}
        self._boot_ids: list[str | None] = [None] * n
        self._down_since: list[float | None] = [None] * n
        self._monitor: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> RayDPClient:
        """Start the replicas (blocking until each has loaded its model)."""
        return cls(ReplicaSet(engine_args))

    def observe(self, registry: Any, model_name: str) -> None:
        """Export to Prometheus: every replica's series under its `engine` label, and the
        router's own."""
        n = self.num_replicas
        self.prometheus = make_prometheus_loggers(registry, model_name, n)
        self.metrics = RouterMetrics(registry, model_name, n)
        record_cache_config(registry, model_name, self.replicas.info.description)  # (each replica's: the same)

    def describe(self) -> dict[str, Any]:
        return {**self.replicas.info.description, "data_parallel_size": self.num_replicas,
                "router_policy": self.replicas.router_config.policy}

    # ------------------------------------------------------------------ lifecycle
    @property
    def serving(self) -> bool:
        return self.dead_error is None and any(self.router.up)

    @property
    def num_waiting(self) -> int:
        """Every up replica's waiting requests (dispatched requests count as waiting at once)."""
        return sum(load.waiting for load, up in zip(self.router.loads, self.router.up, strict=True) if up)

    def start(self, sink: ClientSink) -> None:
        """Start the monitor; with the sink's log line on, one log line per replica."""
        if self._monitor is None:
            self._sink = sink
            if sink.log_stats is not None:
                self.log_stats = [LoggingStatLogger(sink.log_stats.interval, device=self.info.device,
                                                    prefix=f"Engine {i:03d}: ") for i in range(self.num_replicas)]
            self._loop = asyncio.get_running_loop()
            self._monitor = self._loop.create_task(self._watch_replicas())

    def shutdown(self) -> None:
        self._stopping = True
        if self._monitor is not None:
            self._monitor.cancel()
        for flight in list(self._flights.values()):  # no retries while the replicas stop
            if flight.task is not None:
                flight.task.cancel()
        self.replicas.shutdown()

    def encode_chat(self, messages: list[dict], chat_template: str | None = None,
                    add_generation_prompt: bool = True, **kwargs: Any) -> dict[str, Any]:
        return self.replicas.encode_chat(messages, chat_template, add_generation_prompt, **kwargs)

    def watch(self, listener: Callable[[KVSnapshot, float], None] | None) -> None:
        """Nothing to watch: the dashboard shows one engine's block pool (off with replicas)."""

    def run_batch(self, prompts: list[Any], params: list[SamplingParams] | list[PoolingParams],
                  priority: list[int] | None = None, progress: BatchProgress | None = None,
                  lora_requests: list[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """The offline batch, split over the replicas (ReplicaSet.run_batch)."""
        return self.replicas.run_batch(prompts, params, priority, progress, lora_requests)  # type: ignore[arg-type]

    def reset_prefix_cache(self) -> bool:
        return self.replicas.reset_prefix_cache()

    # ------------------------------------------------------------------ requests
    async def add_lora(self, lora_request: LoRARequest) -> bool:
        raise InvalidRequestError(_NO_LORA, param="model")

    async def remove_lora(self, lora_id: int) -> bool:
        return False

    async def prepare(self, request_id: str, prompt: Any, params: SamplingParams | PoolingParams, priority: int,
                      lora_request: LoRARequest | None, arrival_time: float) -> _Request:
        """Route it: the prompt's token ids (tokenized once, here) and block hashes.  The
        replica's InputProcessor checks it."""
        if lora_request is not None:
            raise InvalidRequestError(_NO_LORA, param="model")
        ids, salt = await asyncio.to_thread(routing_tokens, prompt, self.info.tokenizer)  # off the event loop
        if ids is not None and isinstance(prompt, (str, dict)):  # the replica need not tokenize again
            prompt = {**prompt, "prompt_token_ids": ids} if isinstance(prompt, dict) else {
                "prompt": prompt, "prompt_token_ids": ids}
        return _Request(request_id, (request_id, prompt, params, priority, arrival_time),
                        self.router.block_hashes(ids, salt), len(ids or ()))

    async def add_request(self, request: _Request, final_only: bool = False) -> None:
        """Returns once a replica has accepted the request (its refusal raises)."""
        assert self._sink is not None
        request_id = request.request_id
        request.args = (*request.args[:5], final_only)
        flight = _Flight(replica=-1, attempts=0, counted=False)
        self._flights[request_id] = flight
        try:
            gen = await self._dispatch(request, flight, exclude=set())
        except BaseException:
            self._flights.pop(request_id, None)
            raise
        if not self._sink.is_open(request_id):  # closed (abort_all, a drain) while it was being accepted
            self._end(request_id, flight, abort=True)
            self._flights.pop(request_id, None)
            return  # its collector already holds what ended it
        flight.task = asyncio.get_running_loop().create_task(self._pump(request, flight, gen))
        # Runs even when the task is cancelled before it starts: the load count never leaks.
        flight.task.add_done_callback(lambda task: self._end(request_id, flight, abort=task.cancelled()))

    async def _dispatch(self, request: _Request, flight: _Flight, exclude: set[int]) -> Any:
        """Send the request to the router's choice and wait for its acceptance (a refusal
        raises its error).  A replica that fails first is marked down and the request goes
        to another, once per request (`flight.attempts`).  On return the flight names the
        replica and counts in its load."""
        import ray

        while True:
            try:
                decision = self.router.choose(request.hashes, request.num_tokens, exclude)
            except NoReplicaError as e:
                raise EngineDeadError(f"{e}; retry shortly (replicas restart on their own).") from None
            self.router.dispatched(decision.replica, request.hashes)
            flight.replica, flight.counted = decision.replica, True
            if self.metrics is not None:
                self.metrics.requests[decision.replica].inc()
                if decision.affinity:
                    self.metrics.affinity_hits[decision.replica].inc()
            failure: BaseException
            try:
                gen = self.replicas.actors[decision.replica].generate.remote(*request.args)
                first = await (await gen.__anext__())
            except ray.exceptions.RayTaskError as e:  # generate itself raised: a bug, not the input
                self._end(request.request_id, flight, abort=False)
                raise RuntimeError(f"replica {decision.replica} failed the request: {e.cause!r}") from None
            except ray.exceptions.RayError as e:
                failure = e
            except BaseException:  # cancelled while waiting: the replica must not go on alone
                self._end(request.request_id, flight, abort=True)
                raise
            else:
                if not isinstance(first, ReplicaRefusal):
                    return gen
                if first.kind != "dead":
                    self._end(request.request_id, flight, abort=False)
                    raise first.error()
                failure = first.error()
            self._end(request.request_id, flight, abort=True)  # best effort: it may be alive yet
            self._replica_failed(decision.replica, failure)
            if flight.attempts >= 1:
                raise EngineDeadError("The engine replicas given this request failed; retry later.")
            flight.attempts += 1
            exclude.add(decision.replica)
            if self.metrics is not None:
                self.metrics.retries.inc()

    async def _pump(self, request: _Request, flight: _Flight, gen: Any) -> None:
        """Move a request's outputs from its replica to its collector.  On a replica
        failure it goes to another replica if nothing was delivered yet and it has not been
        moved before; every way out leaves a final output or an error in the collector."""
        import ray

        assert self._sink is not None
        sink, request_id = self._sink, request.request_id
        delivered = False
        try:
            while True:
                try:
                    async for ref in gen:
                        out = await ref
                        sink.deliver([out])
                        delivered = True
                        if out.finished:
                            return
                    raise RuntimeError(f"replica {flight.replica} ended the request without a final output")
                except ray.exceptions.RayTaskError as e:  # the replica's stream raised
                    if not isinstance(e.cause, EngineDeadError):
                        sink.fail(request_id, e.cause if isinstance(e.cause, Exception) else RuntimeError(str(e)))
                        return
                    failure: BaseException = e.cause
                except ray.exceptions.RayError as e:  # the replica died or is unreachable
                    failure = e
                failed = flight.replica
                self._replica_failed(failed, failure)
                if delivered or flight.attempts >= 1:
                    sink.fail(request_id, EngineDeadError(f"The engine replica serving this request (replica {failed}) "
                                                  "failed after it had started answering; retry the request."))
                    return
                self._end(request.request_id, flight, abort=True)  # best effort: it may be alive yet
                flight.attempts += 1
                if self.metrics is not None:
                    self.metrics.retries.inc()
                logger.warning("replica %d failed: sending request %s to another replica", failed,
                               request.request_id)
                gen = await self._dispatch(request, flight, exclude={failed})
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the request's error (a refusal, no replica left, a bug)
            sink.fail(request_id, e)

    def abort(self, request_id: str) -> None:
        """Stop a request on its replica.  A stream dropped unread may call this from
        another thread: it hops to the loop."""
        if self._loop is not None and _running_loop() is not self._loop:
            self._loop.call_soon_threadsafe(self.abort, request_id)
            return
        flight = self._flights.get(request_id)
        if flight is None:
            return
        # A pump is cancelled (its done callback aborts the request on its replica); a
        # request still being accepted is ended by add_request, which finds its collector gone.
        if flight.task is not None:
            flight.task.cancel()

    def _end(self, request_id: str, flight: _Flight, abort: bool) -> None:
        """The flight's replica no longer holds the request: take it off the replica's load
        (once), and with `abort` tell the replica to stop it."""
        if flight.counted:
            flight.counted = False
            self.router.ended(flight.replica)
            if abort:
                try:
                    self.replicas.actors[flight.replica].abort.remote(request_id)
                except Exception:  # noqa: BLE001 - a dead replica has nothing left to abort
                    pass
        if flight.task is not None and flight.task.done() and self._flights.get(request_id) is flight:
            del self._flights[request_id]

    # ------------------------------------------------------------------ health and statistics
    def _replica_failed(self, replica: int, reason: BaseException | str) -> None:
        if self.router.up[replica]:
            logger.warning("engine replica %d is down (%s); routing around it until it is back", replica,
                           type(reason).__name__ if isinstance(reason, BaseException) else reason)
            self.router.set_up(replica, False)
            self._down_since[replica] = time.monotonic()
            if self.metrics is not None:
                self.metrics.up[replica].set(0)
            if self.prometheus:
                self.prometheus[replica].engine_down()

    def _replica_answered(self, replica: int, report: ReplicaReport) -> None:
        restarted = self._boot_ids[replica] not in (None, report.boot_id)
        self._boot_ids[replica] = report.boot_id
        if restarted:
            logger.info("engine replica %d restarted", replica)
            self.router.reset(replica)
            if self.prometheus:
                self.prometheus[replica].engine_restarted()
            if self.metrics is not None:
                self.metrics.restarts[replica].inc()
        if not self.router.up[replica]:
            logger.info("engine replica %d is serving again", replica)
            self.router.set_up(replica, True)
            self._down_since[replica] = None
            if self.metrics is not None:
                self.metrics.up[replica].set(1)
        self.router.report(replica, report.num_waiting, report.received)
        if self.prometheus:
            self.prometheus[replica].record(report.sched, report.it)
        if self.log_stats:
            self.log_stats[replica].record(report.sched, report.it)

    async def _watch_replicas(self) -> None:
        n = self.replicas.num_replicas
        polls: dict[int, tuple[asyncio.Future, float]] = {}
        while not self._stopping:
            await asyncio.sleep(STATS_INTERVAL)
            try:
                self._watch_once(polls, n)
            except Exception:  # noqa: BLE001 - the monitor must outlive any one failure
                logger.exception("watching the replicas failed; trying again")

    def _watch_once(self, polls: dict[int, tuple[asyncio.Future, float]], n: int) -> None:
        """One round of the monitor: read the polls that came back, mark replicas down or up,
        send the next polls, write the log lines, give up when every replica stayed down."""
        import ray

        now = time.monotonic()
        for i, (fut, sent) in list(polls.items()):
            if fut.done():
                del polls[i]
                try:
                    report = fut.result()
                except ray.exceptions.RayError as e:
                    self._replica_failed(i, e)
                    continue
                self._replica_answered(i, report)
            elif now - sent > HEALTH_TIMEOUT:
                self._replica_failed(i, f"no answer in {HEALTH_TIMEOUT:g} s")  # keep waiting on the same poll
        for i in range(n):
            if i not in polls:
                polls[i] = (asyncio.wrap_future(self.replicas.actors[i].poll.remote().future()), now)
        for line_logger in self.log_stats:
            line_logger.maybe_log()
        down = [t for t in self._down_since if t is not None]
        if len(down) == n and now - max(down) > REPLICA_DEAD_SECONDS and self.dead_error is None:
            self.dead_error = EngineDeadError(f"every engine replica has been down for over "
                                              f"{REPLICA_DEAD_SECONDS:g} s")
            logger.error("%s; the server gives up", self.dead_error)
            assert self._sink is not None
            self._sink.engine_dead(self.dead_error)

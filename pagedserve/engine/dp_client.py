"""DPAsyncLLM: the OpenAI server's engine client over data-parallel replicas
(`engine/data_parallel.py`).

It satisfies `engine/protocol.py`'s EngineClient, as AsyncLLM does.  It runs on the API
server's event loop, with no thread of its own:
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedserve.config import RouterConfig
from pagedserve.engine.async_llm import (
    EngineDeadError,
    EngineOverloadedError,
    OutputCollector,
    RequestStream,
    check_front_door_limits,
)
from pagedserve.engine.data_parallel import ReplicaRefusal, ReplicaReport, ReplicaSet, routing_tokens
from pagedserve.engine.router import NoReplicaError, Router
from pagedserve.metrics import LoggingStatLogger, PrometheusStatLogger, RouterMetrics
from pagedserve.sampling_params import SamplingParams

logger = logging.getLogger("pagedserve.dp_client")

STATS_INTERVAL = 0.1  # seconds between polls of each replica (loads, metrics, health)
HEALTH_TIMEOUT = 5.0  # a poll unanswered this long marks its replica down
# A replica down this long is given up on; when all are, the client is dead (the server exits).
REPLICA_DEAD_SECONDS = 600.0


@dataclass
class _Flight:
    """One request in flight: where it runs and the task pumping its outputs."""

    replica: int
    attempts: int
    counted: bool = True  # in its replica's load (router.dispatched, not yet router.ended)
    task: asyncio.Task | None = field(default=None, repr=False)


class DPAsyncLLM:
    """The server's engine client over data-parallel replicas (see the module docstring)."""

    def __init__(self, replicas: ReplicaSet, router_config: RouterConfig,
                 prometheus: Sequence[PrometheusStatLogger] = (), router_metrics: RouterMetrics | None = None,
                 log_stats: bool = True, log_interval: float = 10.0, max_waiting_requests: int | None = None,
                 request_timeout: float | None = None,
                 on_dead: Callable[[BaseException], None] | None = None) -> None:
        """`prometheus[i]`: replica i's Prometheus logger (its `engine` label); `on_dead`:
        called once every replica has been down for REPLICA_DEAD_SECONDS."""
        check_front_door_limits(max_waiting_requests, request_timeout)
        self.replicas = replicas
        info = replicas.info
        n = replicas.num_replicas
        self.tokenizer = info.tokenizer
        self.vocab_size = info.vocab_size
        self.sampling_defaults = info.sampling_defaults
        self.structured_outputs_backend = info.structured_outputs_backend
        self.max_waiting_requests = max_waiting_requests
        self.request_timeout = request_timeout
        self.router = Router(router_config, n, info.block_size, info.num_blocks)
        self.metrics = router_metrics
        if prometheus and len(prometheus) != n:
            raise ValueError(f"got {len(prometheus)} Prometheus loggers for {n} replicas")
        self.prometheus = list(prometheus)
        self.log_stats = [LoggingStatLogger(log_interval, device=info.device, prefix=f"Engine {i:03d}: ")
                          for i in range(n)] if log_stats else []
        self._on_dead = on_dead
        self.dead_error: BaseException | None = None
        self._collectors: dict[str, OutputCollector] = {}
        self._flights: dict[str, _Flight] = {}
        self._closed: BaseException | None = None
        self._boot_ids: list[str | None] = [None] * n
        self._down_since: list[float | None] = [None] * n
        self._monitor: asyncio.Task | None = None
        self._stopping = False

    # ------------------------------------------------------------------ lifecycle
    @property
    def errored(self) -> bool:
        return self.dead_error is not None

    @property
    def serving(self) -> bool:
        return self.dead_error is None and any(self.router.up)

    @property
    def num_open_requests(self) -> int:
        return len(self._collectors)

    def start(self) -> None:
        if self._monitor is None:
            self._monitor = asyncio.get_running_loop().create_task(self._watch_replicas())

    def close_admission(self, error: BaseException) -> None:
        self._closed = error

    def abort_all(self, error: BaseException) -> None:
        for request_id in list(self._collectors):
            self._collectors[request_id].put(error)
            self.forget(request_id, abort=True)

    def shutdown(self) -> None:
        self._stopping = True
        if self._monitor is not None:
            self._monitor.cancel()
        self.replicas.shutdown()

    def encode_chat(self, messages: list[dict], chat_template: str | None = None,
                    add_generation_prompt: bool = True, **kwargs: Any) -> dict[str, Any]:
        return self.replicas.encode_chat(messages, chat_template, add_generation_prompt, **kwargs)

    # ------------------------------------------------------------------ requests
    async def add_request(self, request_id: str, prompt: Any, sampling_params: SamplingParams,
                          priority: int = 0, final_only: bool = False) -> RequestStream:
        """As AsyncLLM.add_request: returns once a replica has accepted the request."""
        self.start()
        if self.dead_error is not None:
            raise EngineDeadError(str(self.dead_error))
        if self._closed is not None:
            raise self._closed
        limit = self.max_waiting_requests
        waiting = sum(load.waiting for load, up in zip(self.router.loads, self.router.up, strict=True) if up)
        if limit is not None and waiting >= limit:  # dispatched requests count as waiting at once
            raise EngineOverloadedError(f"The server is overloaded: {limit} requests are already waiting "
                                        "(max_waiting_requests); retry later.")
        if request_id in self._collectors:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids, salt = routing_tokens(prompt, self.tokenizer)
        if ids is not None and isinstance(prompt, (str, dict)):  # the replica need not tokenize again
            prompt = {**prompt, "prompt_token_ids": ids} if isinstance(prompt, dict) else {
                "prompt": prompt, "prompt_token_ids": ids}
        hashes = self.router.block_hashes(ids, salt)
        request = (request_id, prompt, sampling_params, priority, final_only)
        collector = OutputCollector()
        self._collectors[request_id] = collector
        try:
            flight, gen = await self._dispatch(request, hashes, len(ids or ()), exclude=set(), attempts=0)
        except BaseException:
            self._collectors.pop(request_id, None)
            raise
        if request_id not in self._collectors:  # closed (abort_all) while it was being accepted
            self.router.ended(flight.replica)
            self._abort_on(flight.replica, request_id)
            raise asyncio.CancelledError(f"request {request_id} aborted")
        self._flights[request_id] = flight
        flight.task = asyncio.get_running_loop().create_task(
            self._pump(request, hashes, len(ids or ()), flight, gen, collector))
        deadline = None if self.request_timeout is None else time.monotonic() + self.request_timeout
        return RequestStream(self, request_id, collector, deadline, final_only)

    async def _dispatch(self, request: tuple, hashes: list[int], num_tokens: int, exclude: set[int],
                        attempts: int) -> tuple[_Flight, Any]:
        """Send the request to the router's choice and wait for its acceptance; a replica that
        fails first is marked down and the request goes to another (once).  The returned
        flight counts in its replica's load until `_end` takes it off."""
        import ray

        while True:
            try:
                decision = self.router.choose(hashes, num_tokens, exclude)
            except NoReplicaError as e:
                raise EngineDeadError(f"{e}; retry shortly (replicas restart on their own).") from None
            self.router.dispatched(decision.replica, hashes)
            if self.metrics is not None:
                self.metrics.requests[decision.replica].inc()
                if decision.affinity:
                    self.metrics.affinity_hits[decision.replica].inc()
            gen = self.replicas.actors[decision.replica].generate.remote(*request)
            try:
                first = await (await gen.__anext__())
            except ray.exceptions.RayActorError:
                self.router.ended(decision.replica)
                self._replica_failed(decision.replica)
                if attempts >= 1:
                    raise EngineDeadError("The engine replicas serving this request failed; retry later.") from None
                attempts += 1
                exclude.add(decision.replica)
                if self.metrics is not None:
                    self.metrics.retries.inc()
                continue
            except BaseException:
                self.router.ended(decision.replica)
                raise
            if isinstance(first, ReplicaRefusal):
                self.router.ended(decision.replica)
                raise first.error()
            return _Flight(decision.replica, attempts), gen

    async def _pump(self, request: tuple, hashes: list[int], num_tokens: int, flight: _Flight, gen: Any,
                    collector: OutputCollector) -> None:
        """Move a request's outputs from its replica to its collector; on a replica failure,
        retry elsewhere if nothing was delivered yet and it has not been retried."""
        try:
            await self._pump_outputs(request, hashes, num_tokens, flight, gen, collector)
        finally:
            if flight.counted:
                self.router.ended(flight.replica)
            self._flights.pop(request[0], None)

    async def _pump_outputs(self, request: tuple, hashes: list[int], num_tokens: int, flight: _Flight, gen: Any,
                            collector: OutputCollector) -> None:
        import ray

        request_id = request[0]
        delivered = False
        while True:
            try:
                async for ref in gen:
                    out = await ref
                    collector.put(out)
                    delivered = True
                    if out.finished:
                        return
                collector.put(RuntimeError(f"replica {flight.replica} ended request {request_id} without a "
                                           "final output"))
                return
            except ray.exceptions.RayActorError:
                pass
            except ray.exceptions.RayTaskError as e:  # the replica's stream raised
                if not isinstance(e.cause, EngineDeadError):
                    collector.put(e.cause if isinstance(e.cause, Exception) else RuntimeError(str(e)))
                    return
            failed = flight.replica
            self._replica_failed(failed)
            if delivered or flight.attempts >= 1:
                collector.put(EngineDeadError(f"The engine replica serving this request (replica {failed}) failed "
                                              "after it had started answering; retry the request."))
                return
            if self.metrics is not None:
                self.metrics.retries.inc()
            logger.warning("replica %d failed: sending request %s to another replica", failed, request_id)
            self.router.ended(failed)
            flight.counted = False
            try:
                moved, gen = await self._dispatch(request, hashes, num_tokens, exclude={failed},
                                                  attempts=flight.attempts + 1)
            except Exception as e:  # noqa: BLE001 - the request's error, not the pump's
                collector.put(e)
                return
            flight.replica, flight.attempts, flight.counted = moved.replica, moved.attempts, True

    async def abort(self, request_id: str) -> None:
        collector = self._collectors.get(request_id)
        self.forget(request_id, abort=True)
        if collector is not None:
            collector.put(asyncio.CancelledError(f"request {request_id} aborted"))

    def forget(self, request_id: str, abort: bool) -> None:
        """A stream is done with its request (finished, or closed early: abort it)."""
        self._collectors.pop(request_id, None)
        flight = self._flights.pop(request_id, None)
        if flight is None or not abort:
            return
        if flight.task is not None:
            flight.task.cancel()
        self._abort_on(flight.replica, request_id)

    def _abort_on(self, replica: int, request_id: str) -> None:
        try:
            self.replicas.actors[replica].abort.remote(request_id)
        except Exception:  # noqa: BLE001 - a dead replica has nothing left to abort
            pass

    # ------------------------------------------------------------------ health and statistics
    def _replica_failed(self, replica: int) -> None:
        if self.router.up[replica]:
            logger.warning("engine replica %d is down; routing around it until it is back", replica)
            self.router.set_up(replica, False)
            self._down_since[replica] = time.monotonic()
            if self.metrics is not None:
                self.metrics.up[replica].set(0)

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
        self.router.report(replica, report.sched.num_waiting)
        if self.prometheus:
            self.prometheus[replica].record(report.sched, report.it)
        if self.log_stats:
            self.log_stats[replica].record(report.sched, report.it)

    async def _watch_replicas(self) -> None:
        import ray

        n = self.replicas.num_replicas
        polls: dict[int, tuple[asyncio.Future, float]] = {}
        while not self._stopping:
            now = time.monotonic()
            for i in range(n):
                if i not in polls:
                    polls[i] = (asyncio.wrap_future(self.replicas.actors[i].poll.remote().future()), now)
            await asyncio.sleep(STATS_INTERVAL)
            now = time.monotonic()
            for i, (fut, sent) in list(polls.items()):
                if fut.done():
                    del polls[i]
                    try:
                        report = fut.result()
                    except ray.exceptions.RayError:
                        self._replica_failed(i)
                        continue
                    except Exception:  # noqa: BLE001 - the monitor must outlive any one bad answer
                        logger.exception("polling replica %d failed", i)
                        self._replica_failed(i)
                        continue
                    self._replica_answered(i, report)
                elif now - sent > HEALTH_TIMEOUT:
                    self._replica_failed(i)  # unanswered: down, but keep waiting on the same poll
            for line_logger in self.log_stats:
                line_logger.maybe_log()
            down = [t for t in self._down_since if t is not None]
            if len(down) == n and now - max(down) > REPLICA_DEAD_SECONDS and self.dead_error is None:
                self.dead_error = EngineDeadError(f"every engine replica has been down for over "
                                                  f"{REPLICA_DEAD_SECONDS:g} s")
                logger.error("%s; the server gives up", self.dead_error)
                for request_id in list(self._collectors):
                    self._collectors[request_id].put(self.dead_error)
                if self._on_dead is not None:
                    self._on_dead(self.dead_error)

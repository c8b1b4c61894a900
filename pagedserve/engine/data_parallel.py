"""Data parallelism: N engine replicas on Ray behind one router.

Each replica is a Ray actor (`EngineReplica`) holding a whole `LLMEngine`: its own
scheduler, KV cache and, with tensor_parallel_size > 1, its own tensor-parallel worker
processes.  Its resources are one placement-group bundle (CPUs, and the GPUs of its
ranks), so Ray keeps a replica's ranks on one node.  Ray restarts a replica whose process
dies (`max_restarts=-1`); the restarted actor loads the model again.

`ReplicaSet` starts the replicas (joining `ray_address`, or starting a local Ray with
what they need) and serves offline batches (`LLM(..., data_parallel_size=N)`): the
router splits the prompts, each replica runs its share through `LLMEngine.run_batch`.

`DPAsyncLLM` is the server's engine client (`engine/protocol.py`).  It runs on the API
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
import os
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedserve.config import RouterConfig
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.engine.async_llm import (
    AsyncLLM,
    EngineDeadError,
    EngineOverloadedError,
    OutputCollector,
    RequestStream,
    check_front_door_limits,
)
from pagedserve.engine.chat_utils import encode_chat
from pagedserve.engine.llm_engine import BatchProgress
from pagedserve.engine.router import NoReplicaError, Router
from pagedserve.errors import InvalidRequestError
from pagedserve.metrics import (
    IterationStats,
    LoggingStatLogger,
    PrometheusStatLogger,
    RouterMetrics,
    SchedulerStats,
)
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams

logger = logging.getLogger("pagedserve.data_parallel")

RAY_NAMESPACE = "pagedserve"
STATS_INTERVAL = 0.1  # seconds between polls of each replica (loads, metrics, health)
HEALTH_TIMEOUT = 5.0  # a poll unanswered this long marks its replica down
# A replica down this long is given up on; when all are, the client is dead (the server exits).
REPLICA_DEAD_SECONDS = 600.0
PLACEMENT_TIMEOUT = 120.0  # seconds to wait for the cluster to have a replica's resources
ACCEPTED = "accepted"  # a replica's first answer to a request it took


@dataclass
class ReplicaInfo:
    """What the front end needs of the model, from replica 0 (every replica has the same)."""

    tokenizer: Any
    chat_template: str | None
    vocab_size: int
    sampling_defaults: dict[str, Any]
    structured_outputs_backend: str
    max_model_len: int
    block_size: int
    num_blocks: int
    description: dict[str, Any]
    device: str  # "CPU" or "GPU", for the log line


@dataclass
class ReplicaRefusal:
    """A replica refused a request at admission; `error()` rebuilds the exception."""

    message: str
    param: str | None = None
    invalid: bool = True  # a ValueError (400); else a server-side failure (500)

    @classmethod
    def of(cls, e: BaseException) -> ReplicaRefusal:
        if isinstance(e, ValueError):
            return cls(str(e), e.param if isinstance(e, InvalidRequestError) else None)
        return cls(f"{type(e).__name__}: {e}", invalid=False)

    def error(self) -> BaseException:
        if self.invalid:
            return InvalidRequestError(self.message, param=self.param)
        return RuntimeError(self.message)


@dataclass
class ReplicaReport:
    """One poll's answer: the replica's incarnation, its current scheduler statistics, and
    what its steps delivered since the last poll (merged)."""

    boot_id: str
    sched: SchedulerStats
    it: IterationStats


class _StatsRecorder:
    """A stat logger inside a replica: keeps the newest SchedulerStats and merges the
    IterationStats of every step until the next poll takes them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sched = SchedulerStats()
        self._it = IterationStats()

    def record(self, sched: SchedulerStats, it: IterationStats) -> None:
        with self._lock:
            self._sched = sched
            acc = self._it
            acc.num_prompt_tokens += it.num_prompt_tokens
            acc.num_generation_tokens += it.num_generation_tokens
            acc.time_to_first_tokens.extend(it.time_to_first_tokens)
            acc.inter_token_latencies.extend(it.inter_token_latencies)
            acc.finished.extend(it.finished)

    def take(self) -> tuple[SchedulerStats, IterationStats]:
        with self._lock:
            it, self._it = self._it, IterationStats()
            return self._sched, it


class EngineReplica:
    """One data-parallel replica: a Ray actor (see `ReplicaSet`) holding a whole engine.

    Serving goes through an `AsyncLLM` made on the actor's event loop at the first call;
    offline batches through `LLMEngine.run_batch` (a replica does one or the other)."""

    def __init__(self, engine_args: EngineArgs, index: int, num_threads: int) -> None:
        import torch

        from pagedserve.engine.llm_engine import LLMEngine

        logging.basicConfig(level=logging.INFO, format=f"%(levelname)s %(asctime)s replica {index}: %(message)s")
        torch.set_num_threads(num_threads)
        self.index = index
        self.boot_id = uuid.uuid4().hex
        self.engine = LLMEngine.from_engine_args(engine_args.for_replica(index))
        self.stats = _StatsRecorder()
        self.llm: AsyncLLM | None = None

    def _serving(self) -> AsyncLLM:
        if self.llm is None:
            # A dead engine loop kills the process, so Ray restarts the replica.
            self.llm = AsyncLLM(self.engine, stat_loggers=[self.stats], log_stats=False,
                                on_dead=lambda _: os._exit(1))
            self.llm.start()
        return self.llm

    async def info(self) -> ReplicaInfo:
        engine = self.engine
        cache = engine.config.cache_config
        return ReplicaInfo(
            tokenizer=engine.tokenizer, chat_template=engine.chat_template, vocab_size=engine.vocab_size,
            sampling_defaults=engine.sampling_defaults(),
            structured_outputs_backend=engine.structured_outputs_backend, max_model_len=engine.max_model_len,
            block_size=cache.block_size, num_blocks=int(cache.num_blocks or 0), description=engine.describe(),
            device="GPU" if engine.device.type == "cuda" else engine.device.type.upper())

    async def pid(self) -> int:
        return os.getpid()

    async def generate(self, request_id: str, prompt: Any, params: SamplingParams, priority: int,
                       final_only: bool) -> AsyncIterator[Any]:
        """Yields ACCEPTED or a ReplicaRefusal, then (if accepted) the outputs."""
        llm = self._serving()
        try:
            stream = await llm.add_request(request_id, prompt, params, priority, final_only=final_only)
        except Exception as e:  # noqa: BLE001 - the refusal travels back as data
            yield ReplicaRefusal.of(e)
            return
        yield ACCEPTED
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    async def abort(self, request_id: str) -> None:
        if self.llm is not None:
            await self.llm.abort(request_id)

    async def poll(self) -> ReplicaReport:
        self._serving()  # the stats recorder is fed by the serving loop
        sched, it = self.stats.take()
        return ReplicaReport(self.boot_id, sched, it)

    async def run_batch(self, prompts: list[Any], params: list[SamplingParams],
                        priority: list[int] | None) -> list[RequestOutput]:
        return await asyncio.to_thread(self.engine.run_batch, prompts, params, priority)

    async def shutdown(self) -> None:
        if self.llm is not None:
            self.llm.shutdown()
        else:
            self.engine.shutdown()


def _wants_gpu(device: str) -> bool:
    if device.startswith("cuda"):
        return True
    if device != "auto":
        return False
    import torch

    return torch.cuda.is_available()


class ReplicaSet:
    """The replicas of one front end: started in __init__ (blocking until every replica has
    loaded its model), stopped by `shutdown`."""

    def __init__(self, engine_args: EngineArgs) -> None:
        try:
            import ray
            from ray.util.placement_group import placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        except ImportError:
            raise ValueError("data_parallel_size > 1 runs replicas on Ray, which is not installed: "
                             "pip install 'pagedserve[ray]' (or pip install ray)") from None
        self.engine_args = engine_args
        self.router_config = engine_args.router_config()
        n = self.num_replicas = engine_args.data_parallel_size
        tp = engine_args.tensor_parallel_size
        cpus = engine_args.cpus_per_replica or max(1, (os.cpu_count() or 1) // n)
        gpus = tp if _wants_gpu(engine_args.device) else 0
        self.started_ray = False
        # Ray's C++ core would install a fatal-signal handler in this process that turns the
        # server's SIGTERM drain into an abort at ray.shutdown(); the server handles its signals.
        os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
        if not ray.is_initialized():
            if engine_args.ray_address is None:
                # A local Ray with exactly what the replicas reserve; its dashboard is not needed.
                _start_local_ray(num_cpus=n * cpus, num_gpus=n * gpus, include_dashboard=False,
                                 namespace=RAY_NAMESPACE, object_store_memory=256 << 20)
                self.started_ray = True
            else:
                ray.init(address=engine_args.ray_address, namespace=RAY_NAMESPACE)
        bundle = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
        self.name_prefix = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.placement_groups = [placement_group([bundle], strategy="STRICT_PACK") for _ in range(n)]
        for i, pg in enumerate(self.placement_groups):
            ready, _ = ray.wait([pg.ready()], timeout=PLACEMENT_TIMEOUT)
            if not ready:
                self._release()
                raise ValueError(f"the Ray cluster has no room for replica {i} after {PLACEMENT_TIMEOUT:g} s: each "
                                 f"replica needs {bundle} on one node (see cpus_per_replica; "
                                 f"cluster resources: {ray.cluster_resources()})")
        actor_class = ray.remote(EngineReplica)
        self.actors = [
            actor_class.options(
                name=f"{self.name_prefix}-replica-{i}", namespace=RAY_NAMESPACE, max_restarts=-1,
                max_task_retries=0, num_cpus=cpus, num_gpus=gpus, max_concurrency=10_000,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0),
            ).remote(engine_args, i, cpus)
            for i, pg in enumerate(self.placement_groups)
        ]
        logger.info("starting %d engine replicas on Ray (%s per replica)", n, bundle)
        try:
            infos = ray.get([a.info.remote() for a in self.actors])
        except ray.exceptions.RayError as e:
            self._release()
            cause = e.cause if isinstance(e, ray.exceptions.RayTaskError) else None
            if isinstance(e, ray.exceptions.ActorDiedError) and isinstance(e.cause, ray.exceptions.RayTaskError):
                cause = e.cause.cause  # the constructor raised
            if isinstance(cause, (ValueError, FileNotFoundError)):  # bad model or flags: the message says it
                raise ValueError(f"an engine replica failed to start: {cause}") from None
            raise
        self.info: ReplicaInfo = infos[0]

    @property
    def tokenizer(self) -> Any:
        return self.info.tokenizer

    def sampling_defaults(self) -> dict[str, Any]:
        return self.info.sampling_defaults

    def run_batch(self, prompts: list[Any], params: list[SamplingParams], priority: list[int] | None = None,
                  progress: BatchProgress | None = None) -> list[RequestOutput]:
        """The offline batch: the router assigns each prompt a replica (counting what it has
        assigned as load), every replica runs its share at once, outputs come back in
        input order."""
        import ray

        router = Router(self.router_config, self.num_replicas, self.info.block_size, self.info.num_blocks)
        shares: list[list[int]] = [[] for _ in range(self.num_replicas)]
        for i, prompt in enumerate(prompts):
            ids, salt = routing_tokens(prompt, self.info.tokenizer)
            hashes = router.block_hashes(ids, salt)
            replica = router.choose(hashes, len(ids or ())).replica
            router.dispatched(replica, hashes)
            shares[replica].append(i)
        pending = {
            self.actors[r].run_batch.remote([prompts[i] for i in idx], [params[i] for i in idx],
                                            None if priority is None else [priority[i] for i in idx]): idx
            for r, idx in enumerate(shares) if idx
        }
        results: list[RequestOutput | None] = [None] * len(prompts)
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            idx = pending.pop(done[0])
            try:
                outputs = ray.get(done[0])
            except ray.exceptions.RayTaskError as e:
                raise e.cause if isinstance(e.cause, Exception) else e from None
            for i, out in zip(idx, outputs, strict=True):
                results[i] = out
                if progress is not None:
                    progress.finished_one()
            if progress is not None:
                progress.tick()
        return results  # type: ignore[return-value]

    def encode_chat(self, messages: list[dict], chat_template: str | None = None,
                    add_generation_prompt: bool = True, **kwargs: Any) -> dict[str, Any]:
        return encode_chat(self.info.tokenizer, self.info.chat_template, messages, chat_template,
                           add_generation_prompt, **kwargs)

    def _release(self) -> None:
        import ray

        for pg in self.placement_groups:
            ray.util.remove_placement_group(pg)
        if self.started_ray:
            ray.shutdown()

    def shutdown(self) -> None:
        """Let every replica finish its KV tier's writes, then stop them (and a Ray we started)."""
        import ray

        if not ray.is_initialized():
            return
        logger.info("stopping %d engine replicas", self.num_replicas)
        try:
            ray.get([a.shutdown.remote() for a in self.actors], timeout=30)
        except Exception:  # noqa: BLE001 - a dead or stuck replica must not stop the shutdown
            logger.warning("a replica did not shut down cleanly", exc_info=True)
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self._release()


def _start_local_ray(**init_kwargs: Any) -> None:
    """ray.init that starts Ray's own processes (GCS, raylet), from a thread that lives as
    long as this process: they are started with PR_SET_PDEATHSIG, which kills them when the
    *thread* that started them ends (the server loads its engine in a short-lived thread)."""
    import ray

    started = threading.Event()
    failed: list[BaseException] = []

    def keep() -> None:
        try:
            ray.init(**init_kwargs)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            failed.append(e)
            started.set()
            return
        started.set()
        threading.Event().wait()  # never set: the thread's life is what keeps Ray's processes

    threading.Thread(target=keep, name="pagedserve-ray", daemon=True).start()
    started.wait()
    if failed:
        raise failed[0]


def routing_tokens(prompt: Any, tokenizer: Any) -> tuple[list[int] | None, str | None]:
    """The prompt's token ids and cache salt, for routing only: None where they cannot be
    known cheaply or the prompt is malformed (the replica refuses it with the reason)."""
    try:
        salt = None
        if isinstance(prompt, dict):
            salt = prompt.get("cache_salt") if isinstance(prompt.get("cache_salt"), str) else None
            ids = prompt.get("prompt_token_ids")
            if ids is None and isinstance(prompt.get("prompt"), str) and prompt["prompt"] and tokenizer is not None:
                ids = tokenizer.encode(prompt["prompt"])
        elif isinstance(prompt, str) and prompt and tokenizer is not None:
            ids = tokenizer.encode(prompt)
        else:
            ids = prompt
        if isinstance(ids, (list, tuple)) and all(type(t) is int and 0 <= t < 2**62 for t in ids):
            return list(ids), salt
    except Exception:  # noqa: BLE001 - routing never fails a request; the replica judges it
        pass
    return None, None


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
                        self._replica_answered(i, fut.result())
                    except ray.exceptions.RayError:
                        self._replica_failed(i)
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

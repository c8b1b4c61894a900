"""Data parallelism: N engine replicas on Ray behind one router.

Each replica is a Ray actor (`EngineReplica`) holding an engine core: an `LLMEngine`
(InputProcessor + EngineCore, with its own scheduler, KV cache and, with
tensor_parallel_size > 1, its own tensor-parallel worker processes) stepped by an
`InprocClient`'s engine thread.  A replica admits nothing: admission, limits and
deadlines are the front end's `AsyncLLM`'s, once.  Its resources are one placement-group bundle (CPUs, and the GPUs of its
ranks), so Ray keeps a replica's ranks on one node.  Ray restarts a replica whose process
dies (`max_restarts=-1`); the restarted actor loads the model again.

`ReplicaSet` starts the replicas (joining `ray_address`, or starting a local Ray with
what they need) and serves offline batches (`LLM(..., data_parallel_size=N)`): the
router splits the prompts, each replica runs its share through `LLMEngine.run_batch`.

`RayDPClient` (`engine/dp_client.py`) is the EngineCoreClient over them.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import re
import socket
import threading
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.engine.chat_utils import encode_chat, take_images
from pagedserve.engine.core_client import EngineDeadError, OutputCollector, on_own_thread
from pagedserve.engine.inproc_client import InprocClient
from pagedserve.engine.llm_engine import BatchProgress
from pagedserve.engine.router import Router
from pagedserve.errors import ImageInputError, InvalidRequestError, PromptTooLongError, text_model_image_error
from pagedserve.lora.request import LoRARequest
from pagedserve.metrics import IterationStats, LoggingStatLogger, SchedulerStats, StatLogger
from pagedserve.outputs import EngineOutput, RequestOutput
from pagedserve.sampling_params import SamplingParams

logger = logging.getLogger("pagedserve.data_parallel")

RAY_NAMESPACE = "pagedserve"
PLACEMENT_TIMEOUT = 120.0  # seconds to wait for the cluster to have a replica's resources
RAY_CONNECT_TIMEOUT = 10.0  # seconds for a ray_address to accept a connection
REPLICA_START_TIMEOUT = 1800.0  # seconds for every replica to load its model
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
    max_prompt_chars: int  # longer prompt text is refused before tokenizing
    block_size: int
    num_blocks: int
    description: dict[str, Any]
    device: str  # "CPU" or "GPU", for the log line
    takes_images: bool = False  # a vision-language model (replicas do not serve images yet)
    stop_token_ids: tuple[int, ...] = ()
    max_logprobs: int = 20


@dataclass
class ReplicaRefusal:
    """A replica refused a request at admission; `error()` rebuilds the exception.

    kind: "invalid" (a ValueError: 400), "too_long" (a prompt the context cannot hold: a
    400 with OpenAI's code for it), "dead" (its engine died: the front end tries another
    replica), or "error" (500)."""

    message: str
    param: str | None = None
    kind: str = "invalid"

    @classmethod
    def of(cls, e: BaseException) -> ReplicaRefusal:
        if isinstance(e, ValueError):
            return cls(str(e), e.param if isinstance(e, InvalidRequestError) else None,
                       "too_long" if isinstance(e, PromptTooLongError) else "invalid")
        if isinstance(e, EngineDeadError):
            return cls(str(e), kind="dead")
        return cls(f"{type(e).__name__}: {e}", kind="error")

    def error(self) -> BaseException:
        if self.kind in ("invalid", "too_long"):
            return (PromptTooLongError if self.kind == "too_long" else InvalidRequestError)(self.message, param=self.param)
        return (EngineDeadError if self.kind == "dead" else RuntimeError)(self.message)


@dataclass
class ReplicaReport:
    """One poll's answer: the replica's incarnation, its current scheduler statistics, and
    what its steps delivered since the last poll (merged)."""

    boot_id: str
    sched: SchedulerStats
    it: IterationStats
    # Read together on the replica's event loop: requests it has received (`generate`
    # calls) and those of them waiting for a slot now, so the front end knows which of the
    # requests it sent are not in that count yet.
    received: int = 0
    num_waiting: int = 0


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
            self._it.merge(it)

    def take(self) -> tuple[SchedulerStats, IterationStats]:
        with self._lock:
            it, self._it = self._it, IterationStats()
            return self._sched, it


class _ReplicaRequests:
    """The ClientSink of a replica's InprocClient: its requests' collectors, on the actor's
    event loop.  A dead engine loop kills the process, so Ray restarts the replica."""

    def __init__(self, recorder: StatLogger) -> None:
        self.stat_loggers: list[StatLogger] = [recorder]
        self.log_stats: LoggingStatLogger | None = None  # the front end writes each replica's line
        self.collectors: dict[str, OutputCollector] = {}

    def deliver(self, outputs: list[EngineOutput]) -> None:
        for out in outputs:
            collector = self.collectors.get(out.request_id)
            if collector is not None:
                collector.put(out)

    def fail(self, request_id: str, error: BaseException) -> None:
        collector = self.collectors.get(request_id)
        if collector is not None:
            collector.put(error)

    def is_open(self, request_id: str) -> bool:
        return request_id in self.collectors

    def engine_dead(self, error: BaseException) -> None:
        os._exit(1)


_REFUSAL = re.compile(r"^(?:ValueError|FileNotFoundError): ", re.MULTILINE)


def startup_refusal(e: BaseException) -> str | None:
    """The message of the ValueError or FileNotFoundError (a bad model or flag) that a
    replica's constructor raised, from Ray's error; None for any other failure.  A task's
    error keeps the exception; an actor that died in its constructor keeps only the text
    (Ray 2.60's ActorDiedError stores no `cause`: reading one crashed the server with an
    AttributeError instead of the reason), whose last lines are the exception's."""
    import ray

    if isinstance(e, ray.exceptions.RayTaskError):
        return str(e.cause) if isinstance(e.cause, (ValueError, FileNotFoundError)) else None
    if isinstance(e, ray.exceptions.ActorDiedError) and e.actor_init_failed:
        text = str(e).rstrip()
        found = list(_REFUSAL.finditer(text))
        return text[found[-1].end():] if found else None
    return None


class EngineReplica:
    """One data-parallel replica: a Ray actor (see `ReplicaSet`) holding an engine core.

    Serving goes through an `InprocClient` started on the actor's event loop at the first
    call; offline batches through `LLMEngine.run_batch` (a replica does one or the other)."""

    def __init__(self, engine_args: EngineArgs, index: int, num_threads: int) -> None:
        import torch

        from pagedserve.engine.llm_engine import LLMEngine

        logging.basicConfig(level=logging.INFO, format=f"%(levelname)s %(asctime)s replica {index}: %(message)s")
        torch.set_num_threads(num_threads)
        self.index = index
        self.boot_id = uuid.uuid4().hex
        # Built on a thread that ends (core_client.on_own_thread): serving steps it on the client's.
        self.engine = on_own_thread(lambda: LLMEngine.from_engine_args(engine_args.for_replica(index)),
                                    "pagedserve-build")
        self.stats = _StatsRecorder()
        self.requests = _ReplicaRequests(self.stats)
        self.client: InprocClient | None = None
        self.received = 0
        self._admitting: dict[str, bool] = {}  # request id -> aborted while being admitted
        self._batch_lock = asyncio.Lock()  # one offline batch at a time: the engine is not thread-safe

    def _serving(self) -> InprocClient:
        if self.client is None:
            self.client = InprocClient(self.engine)
            self.client.start(self.requests)
        return self.client

    async def info(self) -> ReplicaInfo:
        engine = self.engine
        cache = engine.config.cache_config
        return ReplicaInfo(
            tokenizer=engine.tokenizer, chat_template=engine.chat_template, vocab_size=engine.vocab_size,
            sampling_defaults=engine.sampling_defaults(),
            structured_outputs_backend=engine.structured_outputs_backend, max_model_len=engine.max_model_len,
            max_prompt_chars=engine.max_prompt_chars, block_size=cache.block_size, num_blocks=int(cache.num_blocks or 0), description=engine.describe(),
            device="GPU" if engine.device.type == "cuda" else engine.device.type.upper(),
            takes_images=engine.input_processor.image_prompts is not None,
            stop_token_ids=tuple(engine.stop_token_ids), max_logprobs=engine.max_logprobs)

    async def pid(self) -> int:
        return os.getpid()

    async def generate(self, request_id: str, prompt: Any, params: SamplingParams, priority: int,
                       arrival_time: float, final_only: bool) -> AsyncIterator[Any]:
        """Yields ACCEPTED or a ReplicaRefusal, then (if accepted) the outputs."""
        client = self._serving()
        self.received += 1
        self._admitting[request_id] = False
        collector = OutputCollector()
        try:
            request = await client.prepare(request_id, prompt, params, priority, None, arrival_time)
            self.requests.collectors[request_id] = collector
            await client.add_request(request)
        except Exception as e:  # noqa: BLE001 - the refusal travels back as data
            self.requests.collectors.pop(request_id, None)
            yield ReplicaRefusal.of(e)
            return
        finally:
            aborted = self._admitting.pop(request_id, False)
        finished = False
        try:
            if aborted:  # the front end gave up while its grammar compiled
                return
            yield ACCEPTED
            while not finished:
                out = await collector.get()
                finished = out.finished
                if finished or not final_only:
                    yield out
        finally:
            self.requests.collectors.pop(request_id, None)
            if not finished:  # (FIFO after the add; an id the engine no longer holds is ignored)
                client.abort(request_id)

    async def abort(self, request_id: str) -> None:
        if request_id in self._admitting:
            self._admitting[request_id] = True
        collector = self.requests.collectors.pop(request_id, None)
        if self.client is not None:
            self.client.abort(request_id)
        if collector is not None:
            collector.put(asyncio.CancelledError(f"request {request_id} aborted"))

    async def poll(self) -> ReplicaReport:
        client = self._serving()  # the stats recorder is fed by the serving loop
        sched, it = self.stats.take()
        return ReplicaReport(self.boot_id, sched, it, self.received, client.num_waiting)

    async def run_batch(self, prompts: list[Any], params: list[SamplingParams],
                        priority: list[int] | None, positions: list[int]) -> list[RequestOutput]:
        """This replica's share of a batch; `positions`: each prompt's in the caller's batch."""
        async with self._batch_lock:
            return await asyncio.to_thread(self.engine.run_batch, prompts, params, priority, None, None, positions)

    async def reset_prefix_cache(self) -> bool:
        if self.client is not None:  # (its engine thread steps the scheduler)
            raise RuntimeError("reset_prefix_cache is offline only: this replica is serving")
        async with self._batch_lock:
            return await asyncio.to_thread(self.engine.reset_prefix_cache)

    async def shutdown(self) -> None:
        if self.client is not None:
            self.client.shutdown()
        else:
            self.engine.shutdown()


def _wants_gpu(device: str, cluster: dict[str, float] | None = None) -> bool:
    """Whether replicas reserve GPUs: asked for, or with device "auto" when the cluster
    (a joined one) or else this machine has them."""
    if device.startswith("cuda"):
        return True
    if device != "auto":
        return False
    if cluster is not None:
        return cluster.get("GPU", 0) > 0
    import torch

    return torch.cuda.is_available()


class ReplicaSet:
    """The replicas of one front end: started in __init__ (blocking until every replica has
    loaded its model), stopped by `shutdown`."""

    def __init__(self, engine_args: EngineArgs) -> None:
        # Ray's C++ core would install a fatal-signal handler in this process that turns the
        # server's SIGTERM drain into an abort (exit 134, Ray's agents left running); the
        # server handles its signals.  Read once, when ray is imported: set before that.
        os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
        try:
            import ray
            from ray.util.placement_group import placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        except ImportError:
            raise ValueError("data_parallel_size > 1 runs replicas on Ray, which is not installed: "
                             "pip install 'pagedserve[ray]' (or pip install ray)") from None
        self.engine_args = engine_args
        self._batch_ids = itertools.count()  # the offline outputs' request ids (one engine's count)
        self.router_config = engine_args.router_config()
        n = self.num_replicas = engine_args.data_parallel_size
        tp = engine_args.tensor_parallel_size
        cpus = engine_args.cpus_per_replica or max(1, (os.cpu_count() or 1) // n)
        self.started_ray = False
        if ray.is_initialized():
            if engine_args.ray_address is not None:
                logger.warning("this process is already connected to Ray; ray_address=%s is not used",
                               engine_args.ray_address)
            gpus = tp if _wants_gpu(engine_args.device, ray.cluster_resources()) else 0
        elif engine_args.ray_address is None:
            # A local Ray with exactly what the replicas reserve; its dashboard is not needed.
            gpus = tp if _wants_gpu(engine_args.device) else 0
            _start_local_ray(num_cpus=n * cpus, num_gpus=n * gpus, include_dashboard=False, namespace=RAY_NAMESPACE)
            self.started_ray = True
        else:
            _check_ray_address(engine_args.ray_address)
            try:
                ray.init(address=engine_args.ray_address, namespace=RAY_NAMESPACE)
            except ConnectionError as e:  # ("auto" with no cluster: it was a traceback)
                raise ValueError(f"ray_address {engine_args.ray_address!r}: {e}") from None
            gpus = tp if _wants_gpu(engine_args.device, ray.cluster_resources()) else 0
        if not gpus and engine_args.kv_cache_memory_bytes is None and engine_args.num_gpu_blocks_override is None:
            logger.warning("each CPU replica sizes its KV cache from the memory free on its node when it starts, "
                           "so replicas sharing a node may together take more than one would; set "
                           "--kv-cache-memory-bytes (per replica) to choose")
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
            infos = ray.get([a.info.remote() for a in self.actors], timeout=REPLICA_START_TIMEOUT)
        except ray.exceptions.GetTimeoutError:
            self.shutdown()
            raise ValueError(f"the engine replicas did not load within {REPLICA_START_TIMEOUT:g} s (Ray restarts a "
                             "replica whose process dies while loading: see the replicas' log lines)") from None
        except ray.exceptions.RayError as e:
            self._release()
            why = startup_refusal(e)
            if why is not None:  # bad model or flags: the message says it
                raise ValueError(f"an engine replica failed to start: {why}") from None
            raise
        self.info: ReplicaInfo = infos[0]

    @property
    def tokenizer(self) -> Any:
        return self.info.tokenizer

    def sampling_defaults(self) -> dict[str, Any]:
        return self.info.sampling_defaults

    def run_batch(self, prompts: list[Any], params: list[SamplingParams], priority: list[int] | None = None,
                  progress: BatchProgress | None = None,
                  lora_requests: list[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """The offline batch: the router assigns each prompt a replica (counting what it has
        assigned as load), every replica runs its share at once, outputs come back in
        input order."""
        import ray

        if lora_requests is not None and any(r is not None for r in lora_requests):
            raise ValueError("LoRA adapters do not run on data-parallel replicas (yet): use data_parallel_size=1")

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
                                            None if priority is None else [priority[i] for i in idx], idx): idx
            for r, idx in enumerate(shares) if idx
        }
        results: list[RequestOutput | None] = [None] * len(prompts)
        failure: BaseException | None = None
        while pending:  # every share ends before this returns, even when one failed
            done, _ = ray.wait(list(pending), num_returns=1)
            idx = pending.pop(done[0])
            try:
                outputs = ray.get(done[0])
            except ray.exceptions.RayTaskError as e:
                failure = failure or (e.cause if isinstance(e.cause, Exception) else e)
                continue
            except ray.exceptions.RayError as e:
                failure = failure or RuntimeError(f"an engine replica failed during the batch: {e}")
                continue
            for i, out in zip(idx, outputs, strict=True):
                results[i] = out
                if progress is not None:
                    progress.finished_one()
            if progress is not None:
                progress.tick()
        if failure is not None:
            raise failure
        for out in results:  # (each replica numbers its share: ids of this LLM's, in input order)
            out.request_id = str(next(self._batch_ids))  # type: ignore[union-attr]
        return results  # type: ignore[return-value]

    def reset_prefix_cache(self) -> bool:
        """Every replica's (LLMEngine.reset_prefix_cache): True where each dropped them all."""
        import ray

        return all(ray.get([actor.reset_prefix_cache.remote() for actor in self.actors]))

    def encode_chat(self, messages: list[dict], chat_template: str | None = None,
                    add_generation_prompt: bool = True, **kwargs: Any) -> dict[str, Any]:
        if isinstance(messages, list) and take_images(messages)[1]:
            if not self.info.takes_images:  # (what one engine says first: no replica count would serve them)
                raise text_model_image_error()
            raise ImageInputError("images are not served with data-parallel replicas yet (--data-parallel-size > "
                                  "1): run one replica for image input", param="messages")
        return encode_chat(self.info.tokenizer, self.info.chat_template, messages, chat_template,
                           add_generation_prompt, max_chars=self.info.max_prompt_chars, **kwargs)

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


def _check_ray_address(address: str) -> None:
    """A host:port `ray_address` (or ray://host:port) that nothing answers at is refused by
    name: ray.init retried it without end, the server "loading" for good."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return  # ("auto", "local": Ray's own spellings, which fail fast)
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=RAY_CONNECT_TIMEOUT).close()
    except OSError as e:
        raise ValueError(f"ray_address {address!r}: nothing answers there ({e}); start a Ray head there "
                         "(ray start --head) or leave ray_address out for a local Ray") from None


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

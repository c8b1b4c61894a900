"""Tensor parallelism over N processes, behind the ModelRunner interface the engine uses.

Rank 0 is the engine's own process: it keeps the scheduler and the sampler and
holds a `TPWorker` (its model shard and runner).  Ranks 1..N-1 are spawned worker
processes (worker_proc.py).  Per step, rank 0 pickles the SchedulerOutput once into
shared memory (shm_broadcast.py), then runs its own forward; every rank builds the
same inputs from it and runs its shard; the row-parallel layers all-reduce and the
LM head gathers the logits on rank 0, which samples.  Nothing comes back from the
workers during a step.

Failure handling, because a half-dead group must never hang the engine:
- bad sizes are ValueErrors before any process starts (`validate_tensor_parallel`);
- a monitor thread waits on the workers' process sentinels; when one dies it
  records why, kills the others, and every later or pending call raises
  TensorParallelError (a collective in flight fails at once: gloo sees the
  sockets close);
- any exception (Ctrl-C included) escaping rank 0 mid-step leaves the ranks out of
  step, so the executor shuts down and the engine is done;
- shutdown (explicit, on garbage collection, or at interpreter exit) asks the
  workers to stop, then terminates and finally kills whatever is left.
"""

from __future__ import annotations

import atexit
import datetime
import functools
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import re
import signal
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from pagedserve.config import EngineConfig
from pagedserve.core.sched_output import SchedulerOutput
from pagedserve.distributed.parallel_state import (
    create_store,
    default_backend,
    destroy_distributed,
    init_distributed,
)
from pagedserve.distributed.shm_broadcast import ShmBroadcaster
from pagedserve.executor.abstract import PendingModelOutput
from pagedserve.executor.worker_proc import SHUTDOWN, TPWorker, WorkerArgs, worker_main
from pagedserve.lora.peft import LoRAAdapterError
from pagedserve.lora.request import LoRARequest
from pagedserve.platforms import is_cpu, is_cuda
from pagedserve.utils import is_int
from pagedserve.worker.runner_output import ModelRunnerOutput

logger = logging.getLogger("pagedserve")
T = TypeVar("T")

STARTUP_TIMEOUT_S = 600.0  # spawn + import + load one shard
COLLECTIVE_TIMEOUT_S = 300.0  # a peer alive but stuck this long is an error
_STOP_GRACE_S = 3.0
_RENDEZVOUS_TIMEOUT_S = 60.0


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank died or failed; this engine cannot continue."""


def tp_split_problem(hf_config: Any, tp: int) -> str | None:
    """Why the model cannot be split `tp` ways (the rule the sharded layers rely on), or None."""
    heads = hf_config.num_attention_heads
    kv = getattr(hf_config, "num_key_value_heads", None) or heads
    inter = getattr(hf_config, "intermediate_size", 0)
    if heads % tp:
        return f"it does not divide num_attention_heads={heads}"
    if kv % tp and tp % kv:
        return f"num_key_value_heads={kv} is neither a multiple nor a divisor of it"
    if inter % tp:
        return f"it does not divide intermediate_size={inter}"
    return None


def valid_tp_sizes(hf_config: Any, limit: int = 64) -> list[int]:
    return [n for n in range(1, min(limit, hf_config.num_attention_heads) + 1) if tp_split_problem(hf_config, n) is None]


def validate_tensor_parallel(config: EngineConfig, device: torch.device) -> None:
    """Every reason the model cannot be split N ways, as a ValueError, before any process starts."""
    tp = config.parallel_config.tensor_parallel_size
    if not is_int(tp) or tp < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {tp!r}")
    hf = config.model_config.hf_config
    problem = tp_split_problem(hf, tp)
    if problem:
        raise ValueError(f"tensor_parallel_size={tp} cannot split {config.model_config.model}: {problem}; "
                         f"valid sizes: {', '.join(map(str, valid_tp_sizes(hf)))}")
    backend = config.parallel_config.distributed_backend
    if backend not in (None, "gloo", "nccl"):
        raise ValueError(f"distributed_backend must be 'gloo', 'nccl' or None, got {backend!r}")
    if is_cuda(device):
        first, count = device.index or 0, torch.cuda.device_count()
        if first + tp > count:
            raise ValueError(f"tensor_parallel_size={tp} needs {tp} GPUs from cuda:{first}, "
                             f"but {count} {'is' if count == 1 else 'are'} visible")
    elif is_cpu(device):
        if backend == "nccl":
            raise ValueError("distributed_backend='nccl' needs CUDA devices; use 'gloo' on CPU")
    else:
        raise ValueError(f"tensor parallelism runs on cpu or cuda, not {device.type}")


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "is unresponsive"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class MultiprocExecutor:
    """`execute_model(scheduler_output) -> ModelRunnerOutput` over tensor_parallel_size
    ranks (a ModelExecutor, like ModelRunner), plus `shutdown()`."""

    # Every rank runs each step to completion before rank 0 returns: no overlap yet.
    supports_async_scheduling = False
    kv_tier = None  # EngineArgs refuses a KV tier under tensor parallelism

    def __init__(self, config: EngineConfig, device: torch.device, eos_token_id: Any = None,
                 startup_timeout_s: float = STARTUP_TIMEOUT_S,
                 collective_timeout_s: float = COLLECTIVE_TIMEOUT_S) -> None:
        validate_tensor_parallel(config, device)
        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialized in this process (another "
                               "tensor-parallel LLM still running?): shut that one down first")
        self.config = config
        self.device = device
        self.world_size = tp = config.parallel_config.tensor_parallel_size
        self.timeout_s = collective_timeout_s
        backend = config.parallel_config.distributed_backend or default_backend(device.type)
        self._failure: str | None = None
        self._closed = False
        self._lock = threading.Lock()  # _closed, _failure, the worker processes
        self._call_lock = threading.RLock()  # one call on the ranks at a time (and shutdown)
        self._conn_lock = threading.Lock()  # the pipes: rank 0's calls vs the monitor
        self._backend = backend
        self._monitor_done = threading.Event()
        self._procs: list[Any] = []
        self._conns: list[Any] = []
        self._channel: ShmBroadcaster | None = None
        self._dist = False
        self._threads = torch.get_num_threads()
        self._atexit = functools.partial(_shutdown_ref, weakref.ref(self))
        atexit.register(self._atexit)
        ctx = mp.get_context("spawn")
        threads = max(1, self._threads // tp) if is_cpu(device) else None
        try:
            store = create_store(tp, startup_timeout_s)
            self._channel = ShmBroadcaster(tp - 1, ctx)
            base = device.index or 0
            for rank in range(1, tp):
                dev = "cpu" if is_cpu(device) else f"cuda:{base + rank}"
                args = WorkerArgs(config, rank, tp, backend, dev, store.port, eos_token_id,
                                  self._channel.reader_handle(rank - 1), collective_timeout_s, threads)
                ours, theirs = ctx.Pipe()
                proc = ctx.Process(target=worker_main, args=(args, theirs), name=f"pagedserve-tp{rank}",
                                   daemon=True)
                proc.start()
                theirs.close()
                self._procs.append(proc)
                self._conns.append(ours)
            self._stop_r, self._stop_w = ctx.Pipe(duplex=False)
            threading.Thread(target=_monitor, args=(weakref.ref(self), self._procs, self._stop_r),
                             name="pagedserve-tp-monitor", daemon=True).start()
            for rank in range(1, tp):
                self._recv(rank, startup_timeout_s, expect="hello")
            # Everyone is imported and about to join: a rank dying now must not leave the
            # rendezvous waiting for the whole startup timeout.
            store.set_timeout(datetime.timedelta(seconds=min(startup_timeout_s, _RENDEZVOUS_TIMEOUT_S)))
            group = init_distributed(store, 0, tp, backend, collective_timeout_s)
            self._dist = True
            if threads:
                torch.set_num_threads(threads)
            self.driver = TPWorker(config, device, eos_token_id, group)
            for rank in range(1, tp):
                self._recv(rank, startup_timeout_s)
            num_blocks = min(self.collective_rpc("propose_num_blocks"))
            self.collective_rpc("initialize_kv_cache", num_blocks)
        except BaseException:
            self.shutdown()
            raise
        logger.info("tensor parallel: %d ranks (%s), worker pids %s", tp, backend, self.worker_pids)

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    @property
    def model_runner(self) -> Any:
        """Rank 0's ModelRunner (its KV caches, input batch, device)."""
        return self.driver.runner

    def describe(self) -> dict[str, str]:
        return self.driver.runner.describe()  # every rank runs the same setup

    # ------------------------------------------------------------------ calls
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        def run() -> ModelRunnerOutput:
            self._channel.broadcast(("execute_model", (scheduler_output,), False), self._check, self.timeout_s)
            return self.driver.execute_model(scheduler_output)

        return self._on_all_ranks(run)

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> PendingModelOutput:
        raise NotImplementedError("tensor-parallel execution has no overlap scheduling")

    def add_lora(self, lora_request: LoRARequest) -> None:
        errors = [e for e in self.collective_rpc("add_lora", lora_request) if e]
        if errors:
            raise LoRAAdapterError(errors[0])

    def remove_lora(self, lora_id: int) -> bool:
        return any(self.collective_rpc("remove_lora", lora_id))

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        """Run TPWorker.`method`(*args) on every rank; results in rank order."""
        def run() -> list[Any]:
            self._channel.broadcast((method, args, True), self._check, self.timeout_s)
            results = [getattr(self.driver, method)(*args)]
            return results + [self._recv(rank, self.timeout_s) for rank in range(1, self.world_size)]

        return self._on_all_ranks(run)

    def _on_all_ranks(self, call: Callable[[], T]) -> T:
        """One call that every rank takes part in, one at a time; if rank 0 leaves it
        half-way the executor is shut down and the error says which rank failed."""
        with self._call_lock:
            self._check()
            try:
                return call()
            except BaseException as e:
                err = self._abandon(e)
                if err is e:
                    raise
                raise err from e

    def _abandon(self, error: BaseException) -> BaseException:
        """Rank 0 left a call half-way: the ranks are out of step for good.  Shut down;
        what to raise is a TensorParallelError naming the dead rank when a worker died."""
        if type(error) is not TensorParallelError and isinstance(error, RuntimeError):
            self._monitor_done.wait(2.0)  # a collective failed first: let the monitor say why
        failure = self._failure
        self.shutdown(graceful=False)  # the workers are inside (or past) a step rank 0 left: no one will answer
        if failure and not isinstance(error, (TensorParallelError, KeyboardInterrupt)):
            return TensorParallelError(failure)
        return error

    def check_health(self) -> None:
        self._check()

    def _check(self) -> None:
        if self._failure is not None:
            raise TensorParallelError(self._failure)
        if self._closed:
            raise TensorParallelError("the tensor-parallel executor has been shut down")

    def _recv(self, rank: int, timeout_s: float, expect: str = "ok") -> Any:
        conn, deadline = self._conns[rank - 1], time.monotonic() + timeout_s
        while True:
            with self._conn_lock:
                try:
                    msg = conn.recv() if conn.poll(0.05) else None
                except (EOFError, OSError):
                    msg = ()
            if msg is not None:
                break
            self._check()
            if time.monotonic() > deadline:
                raise TensorParallelError(f"tensor-parallel rank {rank} did not answer within {timeout_s:.0f} s")
        if not msg:
            self._monitor_done.wait(2.0)
            self._check()
            raise TensorParallelError(f"tensor-parallel rank {rank} closed its pipe")
        if msg[0] == "error":
            _, kind, text, detail = msg
            if kind == "ValueError":  # a configuration or checkpoint problem: the message says it
                raise ValueError(text)
            raise TensorParallelError(f"tensor-parallel rank {rank} failed: {kind}: {text}\n{detail}")
        if msg[0] != expect:
            raise TensorParallelError(f"tensor-parallel rank {rank}: expected {expect!r}, got {msg[0]!r}")
        return msg[1]

    # ------------------------------------------------------------------ failure and shutdown
    def _on_worker_exit(self, procs: list[Any]) -> None:
        """Monitor thread: a worker is gone.  Record why and stop the rest, so nothing
        is left running and every rank blocked in a collective fails at once."""
        with self._lock:
            if not self._closed:
                reasons = []
                for p in procs:
                    p.join(1.0)  # its sentinel fires as it exits; the exit status may lag a moment
                    rank = self._procs.index(p) + 1
                    reasons.append(f"tensor-parallel worker rank {rank} (pid {p.pid}) "
                                   f"{_describe_exit(p.exitcode)}{self._last_words(rank)}")
                self._failure = "; ".join(reasons) + "; the engine cannot continue (create a new LLM)"
                logger.error("%s", self._failure)
                for p in self._procs:
                    if p.exitcode is None:
                        p.kill()
                if self._backend == "nccl":
                    _abort_nccl()
        self._monitor_done.set()

    def _last_words(self, rank: int) -> str:
        """The error a dying worker sent, if any (its exception and where it was raised)."""
        msg = None
        with self._conn_lock:
            conn = self._conns[rank - 1]
            try:
                while conn.poll(0):
                    msg = conn.recv()
            except (EOFError, OSError):
                pass
        if not msg or msg[0] != "error":
            return ""
        frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', msg[3])
        where = f" (at {os.path.basename(frames[-1][0])}:{frames[-1][1]} in {frames[-1][2]})" if frames else ""
        return f" after {msg[1]}: {msg[2]}{where}"

    def shutdown(self, graceful: bool = True) -> None:
        """Stop every worker (idempotent): ask (if `graceful`), then terminate, then kill;
        free the channel and the process group."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        atexit.unregister(self._atexit)
        # From another thread (atexit while an engine thread steps): wait for its call to end;
        # if it does not, it is stuck in a collective -- kill the workers, leave the group alone.
        idle = self._call_lock.acquire(timeout=_STOP_GRACE_S)
        try:
            self._stop(graceful and idle, destroy_group=idle)
        finally:
            if idle:
                self._call_lock.release()

    def _stop(self, graceful: bool, destroy_group: bool) -> None:
        if hasattr(self, "_stop_w"):
            try:
                self._stop_w.send(None)
            except OSError:
                pass
        graceful = graceful and self._failure is None and all(p.is_alive() for p in self._procs)
        if graceful and self._channel is not None:
            try:
                self._channel.broadcast((SHUTDOWN, (), False), lambda: None, 1.0)
            except Exception:  # noqa: BLE001 - a stuck worker is terminated below
                pass
        deadline = time.monotonic() + (_STOP_GRACE_S if graceful else 0.0)
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.terminate()
                p.join(1.0)
            if p.is_alive():
                p.kill()
                p.join(1.0)
        for conn in self._conns:
            conn.close()
        if self._dist and destroy_group:
            try:
                destroy_distributed()
            except Exception:  # noqa: BLE001 - peers are gone
                pass
            self._dist = False
        if self._channel is not None:
            try:
                self._channel.close()
            except BufferError:  # a call stuck mid-broadcast still holds a view; unlink happened
                pass
        torch.set_num_threads(self._threads)

    def __del__(self) -> None:
        if getattr(self, "_closed", True) is False:
            try:
                self.shutdown()
            except Exception:  # noqa: BLE001 - interpreter teardown
                pass


def _monitor(ref: weakref.ref, procs: list[Any], stop: Any) -> None:
    """Wait for any worker to exit (or for shutdown); holds no strong reference to the executor."""
    sentinels = {p.sentinel: p for p in procs}
    ready = multiprocessing.connection.wait([*sentinels, stop])
    executor = ref()
    if executor is None or stop in ready:
        return
    executor._on_worker_exit([sentinels[s] for s in ready if s in sentinels])


def _abort_nccl() -> None:
    """Make NCCL collectives blocked on a dead peer return (they would wait forever)."""
    try:
        from torch.distributed.distributed_c10d import _abort_process_group

        _abort_process_group()
    except Exception as e:  # noqa: BLE001 - experimental API; the workers are killed regardless
        logger.warning("could not abort the NCCL process group: %s", e)


def _shutdown_ref(ref: weakref.ref) -> None:
    executor = ref()
    if executor is not None:
        executor.shutdown()

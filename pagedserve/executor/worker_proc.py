"""One tensor-parallel rank: its shard of the model, a ModelRunner, and (ranks > 0) the loop.

Every rank runs the same ModelRunner on the same SchedulerOutput, so every rank
builds identical inputs (token ids, positions, slot mapping, block tables) and
issues the same collectives in the same order; only the LM head differs: rank 0
receives the gathered logits and samples, the others get None and return.

Ranks 1..N-1 live in processes started by `worker_main`: they join the process
group, load their shard, then execute whatever rank 0 broadcasts -- (method, args,
want_reply) -- until told to stop or until rank 0 is gone.  Rank 0 holds a
`TPWorker` in the engine's own process and calls the same methods directly.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import traceback
from dataclasses import dataclass
from typing import Any

import torch

from pagedserve.config import EngineConfig
from pagedserve.core.sched_output import SchedulerOutput
from pagedserve.distributed.parallel_state import (
    TPGroup,
    connect_store,
    destroy_distributed,
    init_distributed,
    set_tp_group,
    tp_group_scope,
)
from pagedserve.distributed.shm_broadcast import ReaderHandle, ShmReader
from pagedserve.lora.request import LoRARequest
from pagedserve.platforms import is_cuda
from pagedserve.worker.runner_output import ModelRunnerOutput

SHUTDOWN = "shutdown"


class TPWorker:
    """A rank's model shard and runner; each method runs on every rank for one RPC."""

    def __init__(self, config: EngineConfig, device: torch.device, eos_token_id: Any, group: TPGroup) -> None:
        from pagedserve.model_loader import get_model
        from pagedserve.worker.model_runner import ModelRunner

        self.group = group
        with tp_group_scope(group):
            model = get_model(config.model_config, device)
        self.runner = ModelRunner(config, model, device, eos_token_id=eos_token_id)

    def propose_num_blocks(self) -> int:
        """The KV blocks this rank could hold; rank 0 takes the minimum over ranks so
        block ids mean the same slots everywhere."""
        return self.runner.propose_num_blocks(host_ranks=self.group.world_size)[0]

    def initialize_kv_cache(self, num_blocks: int) -> int:
        self.runner.config.cache_config.num_blocks = num_blocks
        return self.runner.initialize_kv_cache()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        out = self.runner.execute_model(scheduler_output)
        return out if self.group.is_driver else None

    def add_lora(self, lora_request: LoRARequest) -> str | None:
        """Load this rank's shard of an adapter; what is wrong with it comes back as the
        answer (the request is refused), never as this rank's death."""
        try:
            self.runner.add_lora(lora_request)
        except ValueError as e:
            return str(e)
        return None

    def remove_lora(self, lora_id: int) -> bool:
        return self.runner.remove_lora(lora_id)


@dataclass
class WorkerArgs:
    config: EngineConfig
    rank: int
    world_size: int
    backend: str
    device: str
    store_port: int
    eos_token_id: Any
    channel: ReaderHandle
    timeout_s: float
    num_threads: int | None


class _ParentGone(Exception):
    pass


def worker_main(args: WorkerArgs, conn: Any) -> None:
    """Entry point of ranks 1..N-1 (a spawned process).  Replies on `conn`:
    ("hello", pid) once imported, ("ok", result) per RPC that wants one, and
    ("error", type name, message, traceback) before dying of an exception."""
    # Ctrl-C reaches the whole process group; rank 0 alone decides what happens next.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = mp.parent_process()

    def check_parent() -> None:
        if parent is not None and not parent.is_alive():
            raise _ParentGone

    reader = None
    code = 0
    try:
        conn.send(("hello", os.getpid()))
        if args.num_threads:
            torch.set_num_threads(args.num_threads)
        device = torch.device(args.device)
        if is_cuda(device):
            torch.cuda.set_device(device)
        store = connect_store(args.store_port, args.world_size, args.timeout_s)
        group = init_distributed(store, args.rank, args.world_size, args.backend, args.timeout_s)
        set_tp_group(group)
        reader = ShmReader(args.channel)
        worker = TPWorker(args.config, device, args.eos_token_id, group)
        conn.send(("ok", None))
        while True:
            method, method_args, reply = reader.receive(check_parent)
            if method == SHUTDOWN:
                break
            result = getattr(worker, method)(*method_args)
            if reply:
                conn.send(("ok", result))
    except _ParentGone:
        code = 1
    except BaseException as e:  # noqa: BLE001 - reported to rank 0, then this rank exits
        code = 1
        detail = traceback.format_exc()
        try:
            conn.send(("error", type(e).__name__, str(e), detail))
        except (OSError, ValueError):
            print(f"pagedserve tensor-parallel rank {args.rank}:\n{detail}", file=sys.stderr, flush=True)
    finally:
        if reader is not None:
            reader.close()
        try:
            destroy_distributed()
        except Exception:  # noqa: BLE001 - peers may already be gone
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown (torch takes ~1 s): nothing is left to flush

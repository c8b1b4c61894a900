"""Which tensor-parallel rank this process is, as seen by the layers being built.

A layer reads (rank, world size) once, in its constructor, and keeps it: that is
what decides its shard shape and whether its forward communicates.  So the state
only has to be right while a model is built.  Worker processes (ranks 1..N-1) set
it for their whole life; rank 0 -- the engine's own process -- sets it only around
building its shard (`tp_group_scope`), so a tp=1 model built later in the same
process is not sharded by accident.  One module-level value, like forward_context.

The collectives run on torch.distributed's default process group, which the
executor creates (`init_distributed`) and destroys (`destroy_distributed`); hence
at most one tensor-parallel engine per process at a time.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch.distributed as dist

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    world_size: int = 1
    backend: str | None = None  # "gloo" | "nccl"; None for a single rank

    @property
    def is_driver(self) -> bool:
        """Rank 0 owns the scheduler and the sampler; only it gets full logits."""
        return self.rank == 0


_SINGLE = TPGroup()
_TP: TPGroup = _SINGLE


def get_tp_group() -> TPGroup:
    return _TP


def set_tp_group(group: TPGroup) -> None:
    """For a worker process: its rank, for the rest of its life."""
    global _TP
    _TP = group


@contextmanager
def tp_group_scope(group: TPGroup) -> Iterator[None]:
    """Build layers as `group.rank` of `group.world_size` inside this block only."""
    global _TP
    prev = _TP
    _TP = group
    try:
        yield
    finally:
        _TP = prev


def default_backend(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


def create_store(world_size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0's rendezvous store on a free loopback port (the OS picks it: no race)."""
    return dist.TCPStore(LOOPBACK, 0, world_size, True, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def connect_store(port: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore(LOOPBACK, port, world_size, False, timeout=datetime.timedelta(seconds=timeout_s))


def init_distributed(store: dist.Store, rank: int, world_size: int, backend: str, timeout_s: float) -> TPGroup:
    """Join the default process group.  `timeout_s` bounds every collective: it is
    what turns a hung (alive but stuck) peer into an error.  A peer that dies is
    noticed much sooner -- gloo sees its sockets close, and the executor's monitor
    sees the process exit."""
    if dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is already initialized in this process (another tensor-parallel "
            "engine is running?): shut it down before starting a new one"
        )
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return TPGroup(rank, world_size, backend)


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()

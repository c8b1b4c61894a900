"""The second KV tier under the block pool, as the core sees it.

Blocks live in the pool (worker memory, indexed by block id) and, beneath it, in a
tier that outlives a block's eviction, a preemption and the process: host memory or
a directory on disk (worker/kv_offload.py).  Entries are keyed by the block's
prefix-cache key (the chained token hash, so equal keys mean equal prefixes); the
store itself adds the fingerprint of what makes a block's bytes valid (model, dtype,
block size, layout).

The core only asks which leading keys of a request the tier can supply and commits
to loading them; the bytes move in the worker, described by `KVTransfers` in the
step's SchedulerOutput:

- `loads` run before the step's forward, into blocks just allocated for the hit;
- `copies` too: a radix partial hit copies a pool block's KV into the request's own
  block (core/radix_index.py), sources read before any destination is written;
- `swap_outs` run before the forward too: a request preempted this step (swap mode)
  has its blocks copied out before the step may reuse them;
- `saves` run after the forward, because the step computes their tokens (a block is
  written to the tier as soon as it is full: store-on-compute, so an evicted block
  is already there and a crash loses only the writes in flight).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import xxhash

from pagedserve.core.kv_cache_utils import BlockHash

_MASK_128 = (1 << 128) - 1
# Keys of a preempted request's last, partly filled block (swap mode) sit above the
# range of full blocks' keys (group keys use bits 128.., see block_pool.group_block_key).
_PARTIAL_BIT = 1 << 255


def partial_block_key(parent: BlockHash | None, token_ids: Sequence[int], cache_salt: object = None,
                      images: bytes = b"") -> BlockHash:
    """The tier key of a block holding only `token_ids` (fewer than block_size) after
    the prefix whose last full block hashed to `parent` (None: the first block, whose
    key carries the salt as full first blocks' hashes do): such a block can only be
    resumed into by a sequence with exactly these tokens there.  `images`: the
    identifiers of the images in it (kv_cache_utils.images_in), as a full block's hash has."""
    data = (0 if parent is None else parent & _MASK_128).to_bytes(16, "little")
    if parent is None and cache_salt is not None:
        data += repr((cache_salt,)).encode()
    data += images
    data += b"partial" + len(token_ids).to_bytes(8, "little")
    data += b"".join(t.to_bytes(8, "little", signed=True) for t in token_ids)
    return xxhash.xxh3_128_intdigest(data) | _PARTIAL_BIT


class KVTier(Protocol):
    """What the KV-cache manager needs of the tier (worker/kv_offload.py implements it)."""

    def contains(self, key: BlockHash) -> bool:
        """Whether the entry is stored or on its way (a save already queued)."""
        ...

    def lookup(self, keys: Sequence[BlockHash]) -> int:
        """How many leading keys the tier can supply now, read back and verified (a
        damaged entry is a miss); changes nothing a caller sees."""
        ...

    # Blocks written, and entries found damaged or foreign (for metrics).
    num_stored: int
    num_invalid: int

    def claim(self, keys: Sequence[BlockHash]) -> None:
        """Keep the entries of a lookup that will be loaded this step until the worker
        takes them."""
        ...


@dataclass
class KVTransfers:
    """Block copies between the pool and the tier in one step: (block id, tier key)."""

    loads: list[tuple[int, BlockHash]] = field(default_factory=list)
    # Radix partial hits, within the pool: (source block id, destination block id).
    copies: list[tuple[int, int]] = field(default_factory=list)
    swap_outs: list[tuple[int, BlockHash]] = field(default_factory=list)
    saves: list[tuple[int, BlockHash]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.loads or self.copies or self.swap_outs or self.saves)

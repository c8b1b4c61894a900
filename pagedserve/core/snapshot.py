"""A picture of the KV block pool and the request queues, for people to look at.

The dashboard (entrypoints/dashboard/) draws it live and `pagedserve generate
--show-blocks` prints it as text.  Taking one costs O(changed blocks + listed
requests): the pool records which blocks changed only while someone watches
(`BlockPool.track_changes`), so an unwatched engine pays one `is None` test per pool
call and nothing else.  A snapshot is either full (every block) or a delta (the
blocks changed since the previous one); the queues are always listed whole, up to
`MAX_LISTED_REQUESTS` each.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from itertools import islice
from typing import Protocol

from pagedserve.core.block_pool import BlockPool, KVCacheBlock
from pagedserve.core.request import Request, RequestStatus

# Rows per queue in a snapshot: the page shows counts beyond this, not rows.
MAX_LISTED_REQUESTS = 64
# Hex digits of a block's hash shown to people (enough to tell shared prefixes apart).
HASH_DIGITS = 8

_STATES = {
    RequestStatus.WAITING: "waiting",
    RequestStatus.WAITING_FOR_FSM: "waiting_for_grammar",
    RequestStatus.RUNNING: "running",
    RequestStatus.PREEMPTED: "preempted",
}


def block_state(block: KVCacheBlock) -> tuple[int, int, str | None]:
    """(block id, reference count, hash prefix or None): free is (id, 0, None), cached
    but evictable is (id, 0, hash), in use is ref_cnt >= 1 (shared when >= 2)."""
    digest = None if block.block_hash is None else f"{block.block_hash:032x}"[:HASH_DIGITS]
    return block.block_id, block.ref_cnt, digest


@dataclass
class RequestRow:
    request_id: str
    state: str  # waiting | waiting_for_grammar | running | preempted
    prompt_len: int
    num_computed_tokens: int
    num_output_tokens: int
    block_ids: list[int] = field(default_factory=list)


@dataclass
class KVSnapshot:
    """The block pool (whole or changed blocks) and the two queues at one moment."""

    full: bool
    num_blocks: int
    block_size: int
    null_block_id: int
    blocks: list[tuple[int, int, str | None]]
    running: list[RequestRow]
    waiting: list[RequestRow]
    num_running: int
    num_waiting: int


class RequestQueue(Protocol):
    """The scheduler's running list or waiting queue: sized, iterated in scheduling order."""

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Request]: ...


def take_snapshot(pool: BlockPool, block_size: int, running: RequestQueue, waiting: RequestQueue,
                  block_ids_of: Callable[[str], list[int]], full: bool) -> KVSnapshot:
    """`full`: every block (a new watcher's first picture); else those changed since the
    previous snapshot.  `block_ids_of` gives a request's block ids (the KV-cache
    manager's get_block_ids: asked only for the listed requests)."""
    if full:  # leaves the pending changes to the next delta: it may repeat a block, never miss one
        blocks = [block_state(b) for b in pool.blocks]
    else:
        blocks = [block_state(pool.blocks[i]) for i in pool.take_changed_block_ids()]

    def rows(requests: Iterable[Request]) -> list[RequestRow]:
        return [RequestRow(r.request_id, _STATES.get(r.status, "finished"), r.num_prompt_tokens,
                           r.num_computed_tokens, r.num_output_tokens,
                           block_ids_of(r.request_id))
                for r in islice(requests, MAX_LISTED_REQUESTS)]

    return KVSnapshot(full, pool.num_blocks, block_size, pool.null_block.block_id, blocks, rows(running),
                      rows(waiting), len(running), len(waiting))


# One character per block (or per group of blocks) in the text picture; in a group,
# the busiest state shows (shared over in use over cached over free over the null block).
_FREE, _CACHED, _USED, _SHARED, _NULL = ".", "c", "#", "S", "0"
_RANK = {_NULL: -1, _FREE: 0, _CACHED: 1, _USED: 2, _SHARED: 3}


def render_block_pool(snapshot: KVSnapshot, width: int = 64, max_lines: int = 16) -> str:
    """A full snapshot as text (what `--show-blocks` prints): one character per block,
    `width` a line, or per group of blocks when the pool needs more than `max_lines`
    lines, then a legend with the counts."""
    if not snapshot.full:
        raise ValueError("render_block_pool needs a full snapshot")
    counts = {_FREE: 0, _CACHED: 0, _USED: 0, _SHARED: 0}
    states = []
    for block_id, ref_cnt, digest in snapshot.blocks:
        if block_id == snapshot.null_block_id:
            states.append(_NULL)
            continue
        ch = _SHARED if ref_cnt > 1 else _USED if ref_cnt == 1 else _CACHED if digest is not None else _FREE
        counts[ch] += 1
        states.append(ch)
    group = max(1, -(-len(states) // (width * max_lines)))
    chars = [max(states[i:i + group], key=_RANK.__getitem__) for i in range(0, len(states), group)]
    lines = ["".join(chars[i:i + width]) for i in range(0, len(chars), width)]
    per = f" (one character = {group} blocks)" if group > 1 else ""
    lines.append(f"KV blocks: {snapshot.num_blocks} x {snapshot.block_size} tokens{per}: "
                 f"[{_USED}] in use {counts[_USED]}  [{_SHARED}] shared {counts[_SHARED]}  "
                 f"[{_CACHED}] cached {counts[_CACHED]}  [{_FREE}] free {counts[_FREE]}  [{_NULL}] null block")
    return "\n".join(lines)

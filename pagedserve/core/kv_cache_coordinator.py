"""The KV-cache coordinator: one manager per KV-cache group, and the collaborators
that extend a prefix hit past the pool (vLLM v1's KVCacheCoordinator).

Every group's manager (core/single_type_kv_cache_manager.py) owns that group's
per-request tables and the rules of its attention type; the coordinator keeps them
in step: each request holds the same token positions in every group, blocks are
taken from the pool for all groups at once, a prefix hit is the longest that every
group can serve, and a finished request's blocks go back to the pool together.

Outside, a request's table is position-major over the groups: the block of position
i for group g is `blocks[i * num_groups + g]`, as the runner reads it.  The
coordinator builds that layout from the per-group tables (`interleave`), and takes
each step's new blocks from the pool in that same order, so the block ids the runner
receives do not depend on how the tables are kept.

Past the pool's whole cached blocks, a hit may go on in collaborators
(`KVConnector`): the KV tier (core/kv_tier_connector.py), then the radix tree
(core/radix_matcher.py).  Each is asked in turn at a lookup, told of the admission
that loads what it found, of blocks registered in the prefix cache, of a request
freed or preempted, and of the end of a schedule; the copies they decide go into
the step's KVTransfers.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Protocol

from pagedserve.core.block_pool import BlockPool, KVCacheBlock, require_invariant
from pagedserve.core.kv_cache_utils import BlockHash, hash_request_blocks
from pagedserve.core.kv_tier import KVTransfers
from pagedserve.core.request import Request
from pagedserve.core.single_type_kv_cache_manager import SingleTypeKVCacheManager, make_manager


class KVConnector(Protocol):
    """A source of KV past the pool's cached whole blocks, and what it must hear of a
    request's life.  Only a model of one KV-cache group has any, so the tables and
    blocks they are handed are that group's."""

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Tokens it supplies after the `num_computed_tokens` found before it (pool,
        earlier connectors); remembers what for the admission.  Changes nothing else."""
        ...

    def update_state_after_alloc(self, request: Request, num_pool_blocks: int, new_blocks: Sequence[KVCacheBlock],
                                 transfers: KVTransfers) -> None:
        """The request is admitted with `num_pool_blocks` hit in the pool and these new
        blocks after them: load what the lookup found into them."""
        ...

    def blocks_cached(self, request: Request, blocks: Sequence[KVCacheBlock], start: int, end: int,
                      transfers: KVTransfers) -> None:
        """The request's table positions [start, end) were registered in the prefix cache."""
        ...

    def request_freed(self, request: Request, blocks: Sequence[KVCacheBlock], preempted: bool,
                      transfers: KVTransfers) -> None:
        """The request's blocks (possibly none) are about to be freed: it finished, or
        was preempted."""
        ...

    def schedule_ended(self) -> None:
        """The step's schedule is complete (its transfers are handed to the runner)."""
        ...

    def check_invariants(self, holding: Collection[str]) -> None:
        """Raise AssertionError (require_invariant) if its state is inconsistent;
        `holding`: the requests that hold blocks."""
        ...


def interleave(tables: Sequence[Sequence[KVCacheBlock]]) -> list[KVCacheBlock]:
    """Per-group lists of equal length, position-major: position i of group g at
    i * len(tables) + g."""
    if len(tables) == 1:
        return list(tables[0])
    return [block for position in zip(*tables, strict=True) for block in position]


class KVCacheCoordinator:
    def __init__(self, block_pool: BlockPool, block_size: int, group_windows: Sequence[int | None],
                 enable_caching: bool, connectors: Sequence[KVConnector] = ()) -> None:
        self.block_pool = block_pool
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.managers: list[SingleTypeKVCacheManager] = [make_manager(block_pool, block_size, g, w)
                                                         for g, w in enumerate(group_windows)]
        self.num_groups = len(self.managers)
        # The managers that give blocks back as a request runs (sliding windows).
        self.releasing = [m for m in self.managers if m.window is not None]
        self.connectors = list(connectors)
        # How many leading positions of each request are registered in the prefix cache
        # (the same in every group).
        self.num_cached_block: dict[str, int] = {}
        # Copies between the pool and the tier decided since the last take_transfers().
        self.transfers = KVTransfers()

    # ---------------------------------------------------------------- tables
    def has_request(self, request_id: str) -> bool:
        return request_id in self.num_cached_block

    def request_ids(self) -> Collection[str]:
        """The requests holding tables."""
        return self.num_cached_block.keys()

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        """The request's blocks, position-major over the groups."""
        return interleave([m.get_blocks(request_id) for m in self.managers])

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.get_blocks(request_id)]

    # ---------------------------------------------------------------- lookup
    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash],
                               max_blocks: int) -> tuple[list[list[KVCacheBlock]], int]:
        """Each group's blocks of the longest prefix (at most `max_blocks` positions)
        that every group serves, and its length.  Each manager gives the longest it
        serves within the current bound, which shrinks to the shortest answer until
        all agree: the longest hit every group can serve."""
        found: list[list[KVCacheBlock] | None] = [None] * self.num_groups
        hit, settled = max_blocks, False
        while not settled:
            settled = True
            for g, manager in enumerate(self.managers):
                blocks = found[g]
                if blocks is None or len(blocks) != hit:
                    blocks = found[g] = manager.find_longest_cache_hit(block_hashes, hit)
                if len(blocks) < hit:
                    hit, settled = len(blocks), False
        return [blocks or [] for blocks in found], hit

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The pool's blocks of the request's longest cached prefix (position-major) and
        the tokens of the whole hit: those blocks, then what each connector adds.
        Capped at num_tokens - 1 (the last token is always recomputed for its logits);
        changes nothing but what the connectors remember for the admission."""
        bs = self.block_size
        blocks: list[KVCacheBlock] = []
        num_tokens = 0
        if self.enable_caching:
            hashes = hash_request_blocks(request, bs)
            per_group, num_hit = self.find_longest_cache_hit(hashes, (request.num_tokens - 1) // bs)
            blocks, num_tokens = interleave(per_group), num_hit * bs
        for connector in self.connectors:
            num_tokens += connector.get_num_new_matched_tokens(request, num_tokens)
        return blocks, num_tokens

    # ------------------------------------------------------------ allocation
    def allocate_running(self, request: Request, num_required: int) -> list[KVCacheBlock] | None:
        """A running request's table grows to `num_required` positions (the per-step hot
        path), after giving back what its sliding windows no longer read; None (and
        nothing allocated) when the pool lacks the blocks."""
        req_id = request.request_id
        if self.releasing:
            self.release_out_of_window(req_id, request.num_computed_tokens)
        num_new = (num_required - self.managers[0].num_positions(req_id)) * self.num_groups
        if num_new <= 0:
            return []
        if num_new > self.block_pool.get_num_free_blocks():
            return None
        return self._append_new_blocks(req_id, num_new)

    def allocate_with_hit(self, request: Request, num_required: int, hits: Sequence[KVCacheBlock],
                          num_computed_tokens: int) -> list[KVCacheBlock] | None:
        """Admit the request (or extend it) with a prefix hit (`hits`, position-major, as
        get_computed_blocks gave them; `num_computed_tokens` counts the whole hit) and
        fresh blocks up to `num_required` positions; the connectors load what they
        found.  None, changing nothing, when the pool lacks the blocks: hit blocks
        nobody holds count as free, so taking them costs free space."""
        req_id = request.request_id
        num_groups = self.num_groups
        num_new = (num_required - self.managers[0].num_positions(req_id)) * num_groups - len(hits)
        num_evictable = sum(1 for b in hits if b.ref_cnt == 0 and not b.is_null)
        if num_new + num_evictable > self.block_pool.get_num_free_blocks():
            return None
        if req_id not in self.num_cached_block:
            self.num_cached_block[req_id] = 0
            for manager in self.managers:
                manager.add_request(req_id)
        if hits:
            self.block_pool.touch(hits)
            for g, manager in enumerate(self.managers):
                manager.append_hit(req_id, hits[g::num_groups], num_computed_tokens)
            self.num_cached_block[req_id] = self.managers[0].num_positions(req_id)
        new_blocks = self._append_new_blocks(req_id, num_new) if num_new > 0 else []
        for connector in self.connectors:
            connector.update_state_after_alloc(request, len(hits) // num_groups, new_blocks, self.transfers)
        return new_blocks

    def _append_new_blocks(self, request_id: str, num_blocks: int) -> list[KVCacheBlock]:
        """Take whole positions' blocks from the pool, in the position-major order the
        runner receives them, and give each group its share."""
        new_blocks = self.block_pool.get_new_blocks(num_blocks)
        num_groups = self.num_groups
        for g, manager in enumerate(self.managers):
            manager.append_blocks(request_id, new_blocks[g::num_groups])
        return new_blocks

    def release_out_of_window(self, request_id: str, num_computed_tokens: int) -> None:
        """Every sliding-window group gives back the blocks before the window of the
        next token to compute (group by group, each in position order: their eviction
        order)."""
        released: list[KVCacheBlock] = []
        for manager in self.releasing:
            released += manager.remove_skipped_blocks(request_id, num_computed_tokens)
        if released:
            self.block_pool.free_blocks(released)

    def cache_blocks(self, request: Request, num_full_blocks: int, tell_connectors: bool = True) -> None:
        """Register the request's positions up to `num_full_blocks` (full once this
        step's tokens are computed) in the prefix cache, in every group, and tell the
        connectors (not `tell_connectors`: blocks about to be freed, which a save after
        the next step could find rewritten)."""
        req_id = request.request_id
        start = self.num_cached_block[req_id]
        if num_full_blocks <= start:
            return
        hashes = hash_request_blocks(request, self.block_size, num_full_blocks)
        for manager in self.managers:
            manager.cache_blocks(req_id, hashes, start, num_full_blocks)
        self.num_cached_block[req_id] = num_full_blocks
        if self.connectors and tell_connectors:
            table = self.managers[0].get_blocks(req_id)
            for connector in self.connectors:
                connector.blocks_cached(request, table, start, num_full_blocks, self.transfers)

    # ------------------------------------------------------------------ free
    def free(self, request: Request, preempted: bool = False) -> None:
        """Release the request's blocks, tail first (its last position's last group
        first), so that when they are reused the shareable prefix blocks are evicted
        last; the connectors hear of it first (a swap-out copies the blocks out)."""
        req_id = request.request_id
        if self.connectors:
            table = self.managers[0].get_blocks(req_id)
            for connector in self.connectors:
                connector.request_freed(request, table, preempted, self.transfers)
        if self.num_cached_block.pop(req_id, None) is None:
            return
        tables = [manager.pop(req_id) or [] for manager in self.managers]
        self.block_pool.free_blocks(reversed(interleave(tables)))

    def take_transfers(self) -> KVTransfers | None:
        """The step's copies between pool and tier (None: none), handed to the runner;
        ends the schedule for the connectors."""
        for connector in self.connectors:
            connector.schedule_ended()
        if not self.transfers:
            return None
        transfers, self.transfers = self.transfers, KVTransfers()
        return transfers

    # ------------------------------------------------------------ invariants
    def check_invariants(self) -> None:
        """The tables' part of KVCacheManager.check_invariants, then the pool's and the
        connectors':
          * every group has a table for exactly the admitted requests, all of one
            request's tables the same number of positions;
          * each table obeys its attention type (null entries only lead a
            sliding-window group's table: released out-of-window blocks);
          * a block's ref_cnt is the number of table entries naming it (BlockPool)."""
        holders: dict[int, int] = {}
        req_ids = self.num_cached_block.keys()
        for manager in self.managers:
            require_invariant(manager.req_to_blocks.keys() == req_ids, f"group {manager.group} has tables for "
                              f"{sorted(manager.req_to_blocks)}, admitted are {sorted(req_ids)}")
            for req_id, table in manager.req_to_blocks.items():
                require_invariant(len(table) == self.managers[0].num_positions(req_id),
                                  f"{req_id}'s table is not whole positions")
                manager.check_table(req_id, table)
                for b in table:
                    if not b.is_null:
                        holders[b.block_id] = holders.get(b.block_id, 0) + 1
        self.block_pool.check_invariants(holders)
        for connector in self.connectors:
            connector.check_invariants(req_ids)

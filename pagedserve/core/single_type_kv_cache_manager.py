"""One KV-cache group's block tables: vLLM v1's SingleTypeKVCacheManager.

A model whose layers do not all attend over the whole context (Gemma 3's
sliding-window layers beside its global ones) has its layers split into KV-cache
groups of one attention type each (worker/kv_cache.py), every group with its own
blocks for the same token positions, all drawn from the one pool.  What differs
between attention types lives here, one class per type, so the coordinator
(core/kv_cache_coordinator.py) never asks which type a group is:

- which cached blocks a prefix hit needs (a full-attention group every position, a
  sliding-window group only the window of the first token after the hit);
- which blocks a running request may give back (a sliding-window group's blocks
  before the window of the next token to compute, replaced by the null block);
- how many blocks a request holds at most (`max_blocks_held`, which sizes the pool
  and refuses requests that could never fit).

A manager's table for a request is one block per token position (block_size
tokens), the null block standing for a released one.  Tables only grow at the tail
while the request runs and are dropped whole when it finishes or is preempted.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedserve.core.block_pool import BlockPool, KVCacheBlock, group_block_key, require_invariant
from pagedserve.core.kv_cache_utils import BlockHash
from pagedserve.utils import cdiv


def first_block_in_window(num_computed_tokens: int, window: int, block_size: int) -> int:
    """The first block position a sliding-window layer still reads once
    `num_computed_tokens` tokens are computed: the next token (position
    num_computed_tokens) attends to the `window` tokens ending at itself."""
    return max(0, num_computed_tokens - window + 1) // block_size


class SingleTypeKVCacheManager:
    """The tables of one KV-cache group, and what every attention type does alike.
    Subclasses state the rules of their type; this base is full attention's."""

    # The group's sliding window in tokens (None: the layers attend over everything).
    window: int | None = None

    def __init__(self, block_pool: BlockPool, block_size: int, group: int) -> None:
        self.block_pool = block_pool
        self.block_size = block_size
        self.group = group
        # Each running request's blocks in this group, one per token position.
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}

    # ------------------------------------------------------------------ rules
    @staticmethod
    def max_blocks_held_by(num_tokens: int, block_size: int, window: int | None, max_step_tokens: int) -> int:
        """Most blocks of this type a request of `num_tokens` KV slots holds at once: all."""
        return cdiv(num_tokens, block_size)

    def max_blocks_held(self, num_tokens: int, max_step_tokens: int) -> int:
        """Most blocks this group holds for a request of `num_tokens` KV slots when a step
        computes at most `max_step_tokens` of them."""
        return self.max_blocks_held_by(num_tokens, self.block_size, self.window, max_step_tokens)

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_length: int) -> list[KVCacheBlock]:
        """The group's blocks of the longest cached prefix of at most `max_length`
        positions that this group can serve; a full-attention group reads every
        position, so the prefix stops at its first uncached block."""
        cached = self.block_pool.cached_block_hash_to_block
        group = self.group
        blocks: list[KVCacheBlock] = []
        for block_hash in block_hashes[:max_length]:
            block = cached.get(group_block_key(block_hash, group))
            if block is None:
                break
            blocks.append(block)
        return blocks

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> list[KVCacheBlock]:
        """Take out of the table the blocks the next token will never read (the caller
        frees them); full attention reads everything."""
        return []

    # ---------------------------------------------------------------- tables
    def has_request(self, request_id: str) -> bool:
        return request_id in self.req_to_blocks

    def get_blocks(self, request_id: str) -> Sequence[KVCacheBlock]:
        """The request's table in this group (empty when it holds none)."""
        return self.req_to_blocks.get(request_id, ())

    def num_positions(self, request_id: str) -> int:
        return len(self.req_to_blocks.get(request_id, ()))

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks (not null) the request holds in this group."""
        return sum(1 for b in self.req_to_blocks.get(request_id, ()) if not b.is_null)

    def add_request(self, request_id: str) -> None:
        """A request is admitted: its table starts empty."""
        self.req_to_blocks[request_id] = []

    def append_hit(self, request_id: str, blocks: Sequence[KVCacheBlock], num_computed_tokens: int) -> None:
        """Append a prefix hit's blocks (references already taken), the request
        having `num_computed_tokens` computed once the hit counts."""
        self.req_to_blocks[request_id].extend(blocks)

    def append_blocks(self, request_id: str, blocks: Sequence[KVCacheBlock]) -> None:
        """Append freshly allocated blocks at the tail."""
        self.req_to_blocks[request_id].extend(blocks)

    def cache_blocks(self, request_id: str, block_hashes: Sequence[BlockHash], start: int, end: int) -> None:
        """Register the table's positions [start, end), now full, in the prefix cache."""
        self.block_pool.cache_full_blocks(self.req_to_blocks[request_id], block_hashes, start, end, self.group)

    def pop(self, request_id: str) -> list[KVCacheBlock] | None:
        """Drop the request's table and return it (the coordinator frees the blocks of
        every group together, in eviction order)."""
        return self.req_to_blocks.pop(request_id, None)

    def check_table(self, request_id: str, table: Sequence[KVCacheBlock]) -> None:
        """The invariant of this type's tables: a full-attention table has no null block."""
        require_invariant(not any(b.is_null for b in table), f"{request_id}'s group {self.group} has null blocks "
                          "that are not released leading positions")


class FullAttentionManager(SingleTypeKVCacheManager):
    """Layers that attend over the whole context: the base's rules, as they are."""


class SlidingWindowManager(SingleTypeKVCacheManager):
    """Layers that attend over the last `window` tokens only.  Blocks that fall wholly
    before the window of the next token to compute are given back as decoding moves
    on and the null block takes their place, so the group holds O(window) tokens per
    request, not O(context).  The runner never reads those positions: every attention
    backend starts a sliding layer's keys at its window."""

    def __init__(self, block_pool: BlockPool, block_size: int, group: int, window: int) -> None:
        super().__init__(block_pool, block_size, group)
        self.window = window
        # Leading positions already released (nulled), per request.
        self.num_skipped_block: dict[str, int] = {}

    @staticmethod
    def max_blocks_held_by(num_tokens: int, block_size: int, window: int | None, max_step_tokens: int) -> int:
        """A sliding-window group holds the window of a step's first token through the
        step's last token (at most every position)."""
        assert window is not None
        return min(cdiv(num_tokens, block_size), (window + max_step_tokens - 2) // block_size + 2)

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_length: int) -> list[KVCacheBlock]:
        """Longest hit of at most `max_length` positions whose last window is cached:
        the first token after the hit reads only those blocks, so the positions
        before them need not be (the null block stands for them).  A missing block
        inside the window rules out every longer hit that still reads it, so the
        candidate shrinks to it and the window is checked again."""
        cached = self.block_pool.cached_block_hash_to_block
        bs, window, group = self.block_size, self.window, self.group
        hit = max_length
        while hit > 0:
            first = first_block_in_window(hit * bs, window, bs)
            missing = next((i for i in range(hit - 1, first - 1, -1)
                            if group_block_key(block_hashes[i], group) not in cached), -1)
            if missing < 0:
                break
            hit = missing
        first = first_block_in_window(hit * bs, window, bs)
        return [self.block_pool.null_block] * first + [cached[group_block_key(block_hashes[i], group)]
                                                       for i in range(first, hit)]

    def add_request(self, request_id: str) -> None:
        super().add_request(request_id)
        self.num_skipped_block[request_id] = 0

    def append_hit(self, request_id: str, blocks: Sequence[KVCacheBlock], num_computed_tokens: int) -> None:
        """The hit's leading positions before the window are null already."""
        super().append_hit(request_id, blocks, num_computed_tokens)
        self.num_skipped_block[request_id] = first_block_in_window(num_computed_tokens, self.window, self.block_size)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> list[KVCacheBlock]:
        """Null out the positions before the window of the next token to compute and
        return the blocks they held, in position order.  They stay in the prefix cache
        until evicted."""
        first = first_block_in_window(num_computed_tokens, self.window, self.block_size)
        skipped = self.num_skipped_block[request_id]
        if first <= skipped:
            return []
        table, null = self.req_to_blocks[request_id], self.block_pool.null_block
        released = []
        for i in range(skipped, first):
            block = table[i]
            if not block.is_null:
                released.append(block)
                table[i] = null
        self.num_skipped_block[request_id] = first
        return released

    def pop(self, request_id: str) -> list[KVCacheBlock] | None:
        self.num_skipped_block.pop(request_id, None)
        return super().pop(request_id)

    def check_table(self, request_id: str, table: Sequence[KVCacheBlock]) -> None:
        """Null entries only lead the table: released out-of-window positions."""
        nulls = sum(1 for b in table if b.is_null)
        require_invariant(all(b.is_null for b in table[:nulls]), f"{request_id}'s group {self.group} has null "
                          "blocks that are not released leading positions")


def manager_type(window: int | None) -> type[SingleTypeKVCacheManager]:
    """The manager class of a KV-cache group with this sliding window (None: full attention)."""
    return FullAttentionManager if window is None else SlidingWindowManager


def make_manager(block_pool: BlockPool, block_size: int, group: int, window: int | None) -> SingleTypeKVCacheManager:
    if window is None:
        return FullAttentionManager(block_pool, block_size, group)
    return SlidingWindowManager(block_pool, block_size, group, window)


def max_blocks_held(num_tokens: int, block_size: int, group_windows: tuple[int | None, ...],
                    max_step_tokens: int) -> int:
    """Most blocks a request of `num_tokens` KV slots holds at once, over every group,
    when a step computes at most `max_step_tokens` of them (each type's own rule)."""
    return sum(manager_type(w).max_blocks_held_by(num_tokens, block_size, w, max_step_tokens)
               for w in group_windows)

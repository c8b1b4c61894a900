"""Physical KV blocks: who holds each one, which are free, which hold a cached prefix.

The pool owns only metadata; the KV tensors live in the worker and are indexed by
`block_id`.  A block with ref_cnt 0 sits in the free queue even when it still holds a
cached prefix: it is reusable *and* hittable until popped, and the queue's order is
the eviction order (LRU at the head).  That is why the queue must support O(1)
removal from the middle: a cache hit pulls a block back out of it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from pagedserve.core.kv_cache_utils import BlockHash
from pagedserve.core.radix_index import RadixIndex

# Block hashes are 128-bit; a KV-cache group's blocks are keyed above that range.
_GROUP_SHIFT = 128


def require_invariant(ok: bool, what: str) -> None:
    """The one way a KV-cache integrity check fails (`check_invariants` of the pool, the
    per-group managers, the coordinator and its collaborators), so every broken
    invariant reads alike."""
    if not ok:
        raise AssertionError(f"KV-cache invariant broken: {what}")


def group_block_key(block_hash: BlockHash, group: int) -> BlockHash:
    """The prefix-cache key of a KV-cache group's block of these tokens (group 0's is
    the token hash itself, so a model with one group keys blocks exactly as before)."""
    return block_hash | (group << _GROUP_SHIFT) if group else block_hash


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    # Set once the block is full and registered in the prefix cache.
    block_hash: BlockHash | None = None
    prev_free_block: KVCacheBlock | None = None
    next_free_block: KVCacheBlock | None = None
    is_null: bool = False

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hashed={self.block_hash is not None})"


class FreeKVCacheBlockQueue:
    """Doubly linked list threaded through the blocks themselves, with two sentinels.

    A deque cannot remove from the middle in O(1), and a cache hit must do exactly
    that; the sentinels remove every head/tail special case.
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        prev = self._head
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = self._tail
        self._tail.prev_free_block = prev

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free_block
        if block is self._tail:
            raise ValueError("no free blocks left")
        nxt = block.next_free_block
        self._head.next_free_block = nxt
        nxt.prev_free_block = self._head
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"cannot pop {n} blocks, only {self.num_free_blocks} free")
        out: list[KVCacheBlock] = []
        block = self._head.next_free_block
        for _ in range(n):
            out.append(block)
            nxt = block.next_free_block
            block.prev_free_block = block.next_free_block = None
            block = nxt
        self._head.next_free_block = block
        block.prev_free_block = self._head
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free_block
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self._tail
        self._tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        last = self._tail.prev_free_block
        n = 0
        for block in blocks:
            last.next_free_block = block
            block.prev_free_block = last
            last = block
            n += 1
        last.next_free_block = self._tail
        self._tail.prev_free_block = last
        self.num_free_blocks += n

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        out = []
        block = self._head.next_free_block
        while block is not self._tail:
            out.append(block)
            block = block.next_free_block
        return out


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 2:
            raise ValueError(f"num_blocks must be an integer >= 2 (block 0 is reserved), got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}
        # Block 0 pads block tables; it is never handed out, freed or cached.
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        # Ids of blocks whose ref_cnt or hash changed since take_changed_block_ids(), kept
        # only while someone watches the pool (the dashboard): None costs one test per call.
        self.changed_block_ids: set[int] | None = None
        # The radix tree over the cached blocks (prefix_caching_algo="radix"), set by the
        # KV-cache manager: a block handed out again leaves it.
        self.radix: RadixIndex | None = None

    def track_changes(self, enabled: bool) -> None:
        """Start (from an empty set) or stop recording which blocks change."""
        self.changed_block_ids = set() if enabled else None

    def take_changed_block_ids(self) -> list[int]:
        """The blocks changed since the last call (sorted); empty when not tracking."""
        changed = self.changed_block_ids
        if not changed:
            return []
        self.changed_block_ids = set()
        return sorted(changed)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop from the LRU head, evicting any cached prefix the block still holds."""
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise ValueError(
                f"cannot get {num_blocks} blocks, only {self.free_block_queue.num_free_blocks} free"
            )
        blocks = self.free_block_queue.popleft_n(num_blocks)
        cached, radix = self.cached_block_hash_to_block, self.radix
        for block in blocks:
            if radix is not None:
                radix.remove(block.block_id)
            if block.block_hash is not None:
                if cached.get(block.block_hash) is block:
                    del cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
        if self.changed_block_ids is not None:
            self.changed_block_ids.update(b.block_id for b in blocks)
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """A cache hit: take the block back from the free queue if nobody held it (the
        null block, standing in a hit for a sliding-window group's unneeded positions,
        is nobody's)."""
        queue, changed = self.free_block_queue, self.changed_block_ids
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                queue.remove(block)
            block.ref_cnt += 1
            if changed is not None:
                changed.add(block.block_id)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; blocks reaching 0 join the queue in the given
        order, which is therefore their eviction order (first = evicted first)."""
        released = []
        changed = self.changed_block_ids
        for block in ordered_blocks:
            if block.is_null:
                continue
            if block.ref_cnt <= 0:
                raise ValueError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                released.append(block)
            if changed is not None:
                changed.add(block.block_id)
        self.free_block_queue.append_n(released)

    def cache_full_blocks(self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[BlockHash],
                          num_cached_blocks: int, num_full_blocks: int, group: int = 0) -> None:
        """Register one KV-cache group's table, `blocks` (a request's block per
        position in that group), at positions [num_cached_blocks, num_full_blocks)
        under their token hashes.  Each group's blocks are keyed apart
        (group_block_key), since two groups hold different layers' KV for the same
        tokens.

        If an equal block is already cached (two requests computed the same prefix
        before either was cached), the first stays the canonical copy and the
        newcomer stays private: one key, one block.
        """
        if not self.enable_caching or num_full_blocks <= num_cached_blocks:
            return
        cached = self.cached_block_hash_to_block
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.block_hash is not None or block.is_null:
                continue  # (null: a sliding-window group's block that left the window)
            key = group_block_key(block_hashes[i], group)
            if key not in cached:
                cached[key] = block
                block.block_hash = key
                if self.changed_block_ids is not None:
                    self.changed_block_ids.add(block.block_id)

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of usable blocks held by requests (cached-but-free counts as free)."""
        return 1.0 - self.free_block_queue.num_free_blocks / (self.num_blocks - 1)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached_block_hash_to_block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; refused (False) while any block is in use,
        because running requests' tables would point at blocks that lost their keys."""
        if self.free_block_queue.num_free_blocks != self.num_blocks - 1:
            return False
        for block in self.cached_block_hash_to_block.values():
            block.block_hash = None
            if self.changed_block_ids is not None:
                self.changed_block_ids.add(block.block_id)
        self.cached_block_hash_to_block.clear()
        if self.radix is not None:
            self.radix.clear()
        return True

    def check_invariants(self, holders: Mapping[int, int]) -> None:
        """The pool's part of KVCacheManager.check_invariants, given how many table
        entries name each block (`holders`: block id -> count):
          * the null block is block 0, is never free, held or cached;
          * the free queue holds exactly the blocks nobody holds, and its count is true;
          * a block's ref_cnt is the number of table entries naming it;
          * the prefix cache maps each key to a block carrying that key, and a block
            shared by several tables is the cached one of its key."""
        null = self.null_block
        require_invariant(null is self.blocks[0] and null.is_null and null.block_hash is None,
                          "block 0 is the null block")
        free = self.free_block_queue.get_all_free_blocks()
        require_invariant(len(free) == self.get_num_free_blocks(), f"free queue has {len(free)} blocks, counts "
                          f"{self.get_num_free_blocks()}")
        free_ids = {b.block_id for b in free}
        require_invariant(len(free_ids) == len(free) and null.block_id not in free_ids, "free queue repeats a "
                          "block or holds the null block")
        for b in self.blocks[1:]:
            held = holders.get(b.block_id, 0)
            require_invariant(b.ref_cnt == held, f"{b} is held by {held} tables")
            require_invariant((b.ref_cnt == 0) == (b.block_id in free_ids),
                              f"{b} is {'' if b.block_id in free_ids else 'not '}in the free queue")
            if b.ref_cnt > 1:
                require_invariant(b.block_hash is not None and self.get_cached_block(b.block_hash) is b,
                                  f"{b} is shared but is not the cached block of its key")
        for key, b in self.cached_block_hash_to_block.items():
            require_invariant(b.block_hash == key and not b.is_null, f"{b} is cached under a key it does not carry")

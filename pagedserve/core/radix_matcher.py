"""The radix tree as a collaborator of the KV-cache coordinator (prefix_caching_algo="radix").

core/radix_index.py is the tree: nodes are blocks, keyed by their parent prefix, each
with the tokens it holds.  This class is what the coordinator calls to use it:

- a lookup that the hash chain (and the tier) ended on a block boundary goes on
  token by token into the next block (`get_num_new_matched_tokens`), and the
  admission copies the matching block's KV into the request's own block
  (`update_state_after_alloc`: copy-on-write, in the step's KVTransfers);
- blocks a schedule registers in the prefix cache become nodes when the schedule
  ends (`blocks_cached`, then `schedule_ended`), so no copy reads a block before
  the step writing it has run;
- a request that stops keeps its partly filled last block matchable while the block
  lasts (`request_freed`: a conversation's next turn resumes mid-block).

The tree serves a model of one KV-cache group only (KVCacheManager refuses the rest).
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Sequence

from pagedserve.core.block_pool import BlockPool, KVCacheBlock, require_invariant
from pagedserve.core.kv_cache_utils import BlockHash, hash_request_blocks
from pagedserve.core.kv_tier import KVTransfers
from pagedserve.core.radix_index import RadixIndex
from pagedserve.core.request import Request


def radix_parent(request: Request, position: int) -> Hashable:
    """The radix tree's key of the request's prefix before block `position`."""
    return request.block_hashes[position - 1] if position else ("root", request.hash_salt)


class RadixMatcher:
    def __init__(self, block_pool: BlockPool, block_size: int) -> None:
        self.index = RadixIndex()
        # The pool drops a block's node when it hands the block out again.
        block_pool.radix = self.index
        self.block_pool = block_pool
        self.block_size = block_size
        # A waiting request's partial hit, as its last lookup found it: (the block
        # position it fills, the pool block to copy from).
        self._hits: dict[str, tuple[int, int]] = {}
        # Nodes of blocks this schedule registered, whose KV the step computes.
        self._new_nodes: list[tuple[Hashable, KVCacheBlock, BlockHash, list[int]]] = []

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Tokens of the next block a cached block (or a finished request's last one)
        already holds, past the `num_computed_tokens` found; 0 when those end inside a
        block (a swapped-out request's own last block)."""
        req_id = request.request_id
        self._hits.pop(req_id, None)
        position, offset = divmod(num_computed_tokens, self.block_size)
        start = num_computed_tokens
        limit = min(start + self.block_size, request.num_tokens - 1, request.image_free_until(start))
        if offset or start >= limit:
            return 0
        src, n = self.index.longest_match(radix_parent(request, position), request.all_token_ids[start:limit])
        if n:
            self._hits[req_id] = (position, src)
        return n

    def update_state_after_alloc(self, request: Request, num_pool_blocks: int, new_blocks: Sequence[KVCacheBlock],
                                 transfers: KVTransfers) -> None:
        """Copy the partial hit's block into the request's own block at its position."""
        hit = self._hits.pop(request.request_id, None)
        if hit is not None:
            position, src = hit
            transfers.copies.append((src, new_blocks[position - num_pool_blocks].block_id))

    def blocks_cached(self, request: Request, blocks: Sequence[KVCacheBlock], start: int, end: int,
                      transfers: KVTransfers) -> None:
        """Blocks this request registered in the prefix cache at [start, end) become
        nodes once this step has computed them (see schedule_ended)."""
        bs, hashes, tokens = self.block_size, request.block_hashes, request.all_token_ids
        for i in range(start, end):
            block = blocks[i]
            if block.block_hash == hashes[i]:
                self._new_nodes.append((radix_parent(request, i), block, hashes[i], tokens[i * bs:(i + 1) * bs]))

    def request_freed(self, request: Request, blocks: Sequence[KVCacheBlock], preempted: bool,
                      transfers: KVTransfers) -> None:
        """The request's partly filled last block stays matchable while it lasts."""
        self._hits.pop(request.request_id, None)
        if not blocks:
            return
        position, n = divmod(request.num_computed_tokens, self.block_size)
        # (Its parent may be a block completed by accepted drafts, never hashed yet.)
        hash_request_blocks(request, self.block_size, position)
        if n and position < len(blocks) and blocks[position].block_hash is None:
            start = position * self.block_size
            self.index.insert(radix_parent(request, position), blocks[position].block_id,
                              request.all_token_ids[start:start + n])

    def schedule_ended(self) -> None:
        """The schedule's registered blocks become matchable: a later step's copy runs
        after this step has written them."""
        for parent, block, key, tokens in self._new_nodes:
            if block.block_hash == key:  # (not handed out again meanwhile)
                self.index.insert(parent, block.block_id, tokens)
        self._new_nodes.clear()

    def check_invariants(self, holding: Collection[str]) -> None:
        """Radix nodes are blocks nobody writes into: free ones or cached ones."""
        index, blocks = self.index, self.block_pool.blocks
        for block_id, parent in index.parent_of.items():
            b = blocks[block_id]
            require_invariant(block_id in index.children.get(parent, {}), f"radix node {block_id} is not its "
                              "parent's child")
            require_invariant(b.ref_cnt == 0 or b.block_hash is not None, f"radix node {b} is being written")

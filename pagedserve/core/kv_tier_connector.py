"""The KV tier as a collaborator of the KV-cache coordinator (vLLM v1's KV connector).

The tier itself (core/kv_tier.py: the protocol; worker/kv_offload.py: host memory or
a directory) only stores and reads back blocks by key.  This class decides, for the
core, what moves between it and the pool, in three moments of a request's life:

- a lookup that stops in the pool goes on in the tier (`get_num_new_matched_tokens`),
  and the admission that follows loads what it found into the request's fresh blocks
  instead of computing them (`update_state_after_alloc`);
- every block registered in the prefix cache is saved after the step that computes it
  (`blocks_cached`: store-on-compute, so an evicted block is already there);
- under preemption_mode="swap" a preempted request's computed blocks, its partly
  filled last one included, are copied out before they are freed
  (`request_freed`), and its resumption finds them by the same lookup.

It only decides: the copies travel in the step's KVTransfers, which the runner
performs.  A tier serves a model of one KV-cache group only (KVCacheManager refuses
the rest), so the tables it is handed are that group's.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from pagedserve.core.block_pool import KVCacheBlock, require_invariant
from pagedserve.core.kv_cache_utils import BlockHash, hash_request_blocks, images_in
from pagedserve.core.kv_tier import KVTier, KVTransfers, partial_block_key
from pagedserve.core.request import Request


@dataclass(slots=True)
class SwappedTail:
    """A swapped-out request's last block as it went to the tier: its position, the
    tokens it held (0, and no key, when the request's KV ended on a block boundary)."""

    position: int
    num_tokens: int
    key: BlockHash | None


@dataclass(slots=True)
class TierHit:
    """What a waiting request's lookup found in the tier, for the admission that loads
    it: whole blocks up to position `end`, then its own swapped-out partial block
    (`tail_key`) if that matched too; `num_tokens` in all."""

    end: int
    tail_key: BlockHash | None
    num_tokens: int


class TierConnector:
    def __init__(self, tier: KVTier, block_size: int, enable_caching: bool, swap: bool,
                 store_computed: bool) -> None:
        """`swap`: preempted requests are copied out (preemption_mode="swap");
        `store_computed`: the tier is a prefix cache too, so every computed block goes to
        it (False: a tier for swapping only); `enable_caching`: without prefix caching
        the tier only gives a swapped-out request its own blocks back."""
        self.tier = tier
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.swap = swap
        self.store_computed = store_computed
        # Each swapped-out request's last block in the tier, until it resumes or ends.
        self.swapped: dict[str, SwappedTail] = {}
        # Each waiting request's last lookup hit in the tier (see TierHit).
        self._hits: dict[str, TierHit] = {}
        # Tokens asked of the tier (past the pool's hit) and loaded from it, every admission.
        self.num_queries = 0
        self.num_hits = 0

    # ----------------------------------------------------------------- lookup
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Tokens the tier supplies past the pool's hit of `num_computed_tokens` (whole
        blocks): whole blocks, then for a request swapped out its partly filled last
        block, all in one lookup.  Capped at num_tokens - 1, like every hit.  Changes
        nothing but what the admission will load."""
        req_id = request.request_id
        self._hits.pop(req_id, None)
        tail = self.swapped.get(req_id)
        if not self.enable_caching and tail is None:
            return 0
        bs = self.block_size
        hashes = hash_request_blocks(request, bs)
        start, max_blocks = num_computed_tokens // bs, (request.num_tokens - 1) // bs
        if tail is not None and tail.num_tokens and start <= tail.position <= max_blocks:
            keys = [*hashes[start:tail.position], tail.key]
            found = self.tier.lookup(keys)
            if found == len(keys):
                num_tokens = min(tail.position * bs + tail.num_tokens, request.num_tokens - 1) - num_computed_tokens
                self._hits[req_id] = TierHit(tail.position, tail.key, num_tokens)
                return num_tokens
        elif start < max_blocks:
            found = self.tier.lookup(hashes[start:max_blocks])
        else:
            found = 0
        if found:
            self._hits[req_id] = TierHit(start + found, None, found * bs)
        return found * bs

    def update_state_after_alloc(self, request: Request, num_pool_blocks: int, new_blocks: Sequence[KVCacheBlock],
                                 transfers: KVTransfers) -> None:
        """The request is admitted with `num_pool_blocks` hit in the pool: its lookup's
        tier blocks are loaded into the first of its `new_blocks`."""
        req_id = request.request_id
        tail = self.swapped.pop(req_id, None)
        hit = self._hits.pop(req_id, None)
        if self.enable_caching or tail is not None:  # it was asked
            self.num_queries += request.num_tokens - num_pool_blocks * self.block_size
        if hit is None:
            return
        keys = request.block_hashes[num_pool_blocks:hit.end]
        if hit.tail_key is not None:
            keys.append(hit.tail_key)
        if keys:
            self.tier.claim(keys)
            transfers.loads.extend((b.block_id, k) for b, k in zip(new_blocks, keys, strict=False))
            self.num_hits += hit.num_tokens

    # ------------------------------------------------------------ life cycle
    def blocks_cached(self, request: Request, blocks: Sequence[KVCacheBlock], start: int, end: int,
                      transfers: KVTransfers) -> None:
        """Store-on-compute: blocks this request registered in the prefix cache at
        positions [start, end) go to the tier after the step (the canonical copy only:
        a block another request cached first is that request's to save)."""
        if not self.store_computed:
            return
        tier, saves, hashes = self.tier, transfers.saves, request.block_hashes
        for i in range(start, end):
            block, key = blocks[i], hashes[i]
            if block.block_hash == key and not tier.contains(key):
                saves.append((block.block_id, key))

    def request_freed(self, request: Request, blocks: Sequence[KVCacheBlock], preempted: bool,
                      transfers: KVTransfers) -> None:
        """A preempted request is swapped out (swap mode); a finished one forgets what
        it had in the tier."""
        req_id = request.request_id
        self._hits.pop(req_id, None)
        if not preempted:
            self.swapped.pop(req_id, None)
        elif self.swap and blocks:
            self._swap_out(request, blocks, transfers)

    def _swap_out(self, request: Request, blocks: Sequence[KVCacheBlock], transfers: KVTransfers) -> None:
        """Copy the request's computed KV to the tier, blocks the tier lacks and the
        partly filled last one, so that it resumes by loading them.  A tier that cannot
        hold them drops the oldest entries or these (it stays bounded): whatever is
        missing then is recomputed."""
        bs, num_computed = self.block_size, request.num_computed_tokens
        num_full = min(num_computed // bs, len(blocks))
        hashes = hash_request_blocks(request, bs, num_full)
        out = transfers.swap_outs
        pending = {k for _, k in out}
        for i in range(num_full):
            if not self.tier.contains(hashes[i]) and hashes[i] not in pending:
                out.append((blocks[i].block_id, hashes[i]))
        partial = num_computed - num_full * bs
        if partial and num_full < len(blocks):
            tokens = request.all_token_ids[num_full * bs:num_computed]
            key = partial_block_key(hashes[num_full - 1] if num_full else None, tokens, request.hash_salt,
                                    images_in(request.images, num_full * bs, num_computed))
            out.append((blocks[num_full].block_id, key))
            self.swapped[request.request_id] = SwappedTail(num_full, partial, key)
        else:
            self.swapped[request.request_id] = SwappedTail(num_full, 0, None)

    def schedule_ended(self) -> None:
        """Nothing waits for the end of a schedule here."""

    def check_invariants(self, holding: Collection[str]) -> None:
        """A swapped-out request holds no blocks (`holding`: the requests that do)."""
        for req_id in holding:
            require_invariant(req_id not in self.swapped, f"swapped-out {req_id} still holds blocks")

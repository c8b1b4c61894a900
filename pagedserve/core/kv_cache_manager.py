"""Per-request block tables on top of the BlockPool, with prefix caching.

The scheduler speaks tokens; this class turns token counts into blocks.  A
request's table only grows while it runs and is dropped whole when it finishes
or is preempted.  Full blocks are registered in the prefix cache as soon as they
are allocated for tokens that this step will compute, so a request admitted later
in the same step (an n>1 sibling) already shares them: the runner writes a step's
new KV before any attention reads it, layer by layer.

KV-cache groups (vLLM v1's hybrid cache): a model whose layers do not all attend
over the whole context (Gemma 3's sliding-window layers beside its global ones)
has its layers split into groups of one attention type each, every group with
its own blocks for the same token positions, all drawn from the one pool (the
worker makes a block hold the same number of layers in every group).  A
request's table is position-major: the block of position i for group g is
`blocks[i * num_groups + g]`.  In a group with a sliding window of W tokens, a
block whose tokens all lie before the window of the next token to compute is
released as decoding moves on and replaced by the null block, so those layers
hold O(W) tokens per request, not O(context).  A model with one full-attention
group (every dense model) has tables of one block per position, as before.

Beneath the pool an optional tier (core/kv_tier.py) keeps blocks past their
eviction: a prefix lookup that stops in the pool goes on in the tier, and the blocks
it finds there are loaded into fresh blocks instead of being recomputed.  Every
block registered in the prefix cache is saved to the tier once the step computing
it has run; in swap mode a preempted request's blocks, its partly filled last one
included, are copied out before they are freed.
"""

from __future__ import annotations

from pagedserve.core.block_pool import BlockPool, KVCacheBlock, group_block_key
from pagedserve.core.kv_cache_utils import BlockHash, extend_block_hashes
from pagedserve.core.kv_tier import KVTier, KVTransfers, partial_block_key
from pagedserve.core.radix_index import RadixIndex
from pagedserve.core.request import Request
from pagedserve.utils import cdiv


def first_block_in_window(num_computed_tokens: int, window: int, block_size: int) -> int:
    """The first block position a sliding-window layer still reads once
    `num_computed_tokens` tokens are computed: the next token (position
    num_computed_tokens) attends to the `window` tokens ending at itself."""
    return max(0, num_computed_tokens - window + 1) // block_size


def max_blocks_held(num_tokens: int, block_size: int, group_windows: tuple[int | None, ...],
                    max_step_tokens: int) -> int:
    """Most blocks a request of `num_tokens` KV slots holds at once, over every group,
    when a step computes at most `max_step_tokens` of them: a sliding-window group
    holds the window of a step's first token through the step's last."""
    positions = cdiv(num_tokens, block_size)
    return sum(positions if w is None else min(positions, (w + max_step_tokens - 2) // block_size + 2)
               for w in group_windows)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, max_model_len: int, enable_caching: bool = True,
                 group_windows: tuple[int | None, ...] = (None,), tier: KVTier | None = None,
                 swap: bool = False, radix: bool = False, store_computed: bool = True) -> None:
        """`group_windows`: each KV-cache group's sliding window in tokens (None: full
        attention); the executor reports them with the pool's size.  `tier`: the KV
        tier beneath the pool (None: none); `swap`: preempted requests are copied out
        to it (preemption_mode="swap") instead of being recomputed; `radix`: the radix
        tree's token-granular matching after the hash chain's (core/radix_index.py);
        `store_computed`: the tier is a prefix cache too, so every computed block goes
        to it (False: a tier for swapping only)."""
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        if not isinstance(max_model_len, int) or max_model_len < 1:
            raise ValueError(f"max_model_len must be a positive integer, got {max_model_len!r}")
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.num_blocks = num_blocks
        if not group_windows or any(w is not None and (not isinstance(w, int) or w < 1) for w in group_windows):
            raise ValueError(f"group_windows must name each KV-cache group's sliding window (a positive "
                             f"integer) or None for full attention, got {group_windows!r}")
        self.group_windows = tuple(group_windows)
        self.num_groups = len(self.group_windows)
        self.sliding_groups = [(g, w) for g, w in enumerate(self.group_windows) if w is not None]
        self.full_groups = [g for g, w in enumerate(self.group_windows) if w is None]
        if swap and tier is None:
            raise ValueError("swap preemption needs a KV tier to swap to")
        if tier is not None and self.sliding_groups:
            raise ValueError("a KV tier (kv_offload_dir, kv_offload_bytes, preemption_mode='swap') is not supported "
                             "yet for models with several KV-cache groups (sliding-window layers)")
        if radix and (self.sliding_groups or not enable_caching):
            raise ValueError("prefix_caching_algo='radix' needs prefix caching and a model of one KV-cache group "
                             "(no sliding-window layers)")
        self.tier = tier
        self.swap = swap
        self.store_computed = tier is not None and store_computed
        self.radix = RadixIndex() if radix else None
        self.block_pool.radix = self.radix
        # A waiting request's hit that ends inside a block, as its lookup found it: (the
        # position, a pool block to copy (radix) or None, a tier key to load (its own
        # swapped-out block) or None), for the admission that fills it.
        self._partial_src: dict[str, tuple[int, int | None, BlockHash | None]] = {}
        # Radix nodes of blocks this schedule registered, whose KV the step computes:
        # published when the schedule ends, so no copy reads a block before it is written.
        self._radix_pending: list[tuple[object, KVCacheBlock, int, list[int]]] = []
        # Copies between the pool and the tier decided since the last take_transfers().
        self._transfers = KVTransfers()
        # Swap mode: each swapped-out request's partly filled last block in the tier, as
        # (its position, tokens in it, tier key; 0 and None when its KV ended on a block
        # boundary), until the request resumes or ends.
        self.swapped: dict[str, tuple[int, int, BlockHash | None]] = {}
        # Each request's blocks, position-major over the groups (see the module docstring).
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading positions of each request are registered in the prefix cache.
        self.num_cached_block: dict[str, int] = {}
        # Sliding-window groups: leading positions already released (nulled), per request.
        self.num_skipped_block: dict[str, int] = {}
        # Prefix-cache statistics in tokens (see _record_prefix_lookup).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.prefix_cache_requests = 0
        self.preempted_prefix_cache_queries = 0
        self.preempted_prefix_cache_hits = 0
        # Tokens asked of the tier (past the pool's hit) and loaded from it, every admission.
        self.tier_queries = 0
        self.tier_hits = 0

    # ------------------------------------------------------------------ lookups
    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block ids, position-major over the groups (0: a released
        sliding-window block, never read)."""
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def num_held_blocks(self, request_id: str, group: int) -> int:
        """Blocks (not null) the request holds in one KV-cache group."""
        blocks = self.req_to_blocks.get(request_id, ())
        return sum(1 for b in blocks[group::self.num_groups] if not b.is_null)

    def _hash_blocks(self, request: Request, num_full_blocks: int | None = None) -> list[int]:
        return extend_block_hashes(
            request.block_hashes, request.all_token_ids, self.block_size, num_full_blocks, request.hash_salt
        )

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of the request: whole blocks from the pool, then
        whole blocks (and, for a request swapped out, its partly filled last block)
        from the tier; returns the pool's blocks and the tokens of both.

        Capped at num_tokens - 1: the last token is always recomputed because its
        logits are what the next sample needs.  Takes no references and changes
        nothing (a request stuck at the head of the queue is looked up every step);
        pass the result to allocate_slots in the same step, which counts the hit and
        loads the tier's blocks.
        """
        if request.needs_every_prompt_state:
            return [], 0
        # Without prefix caching the tier only gives a swapped-out request its own blocks back.
        use_tier = self.tier is not None and (self.enable_caching or request.request_id in self.swapped)
        if not self.enable_caching and not use_tier:
            return [], 0
        block_hashes = self._hash_blocks(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        cached = self.block_pool.cached_block_hash_to_block
        if self.sliding_groups:
            num_hit = self._longest_hybrid_hit(block_hashes[:max_blocks])
            return self._hybrid_hit_blocks(block_hashes, num_hit), num_hit * self.block_size
        blocks: list[KVCacheBlock] = []
        if self.enable_caching:  # one full-attention group: the plain prefix walk
            for block_hash in block_hashes[:max_blocks]:
                block = cached.get(block_hash)
                if block is None:
                    break
                blocks.append(block)
        num_hit = len(blocks)
        self._partial_src.pop(request.request_id, None)
        tail = self.swapped.get(request.request_id) if use_tier else None
        if tail is not None and tail[1] and num_hit <= tail[0] <= max_blocks:
            # One lookup for the whole blocks and the swapped-out partial one after them.
            keys = [*block_hashes[num_hit:tail[0]], tail[2]]
            found = self.tier.lookup(keys)
            if found == len(keys):
                self._partial_src[request.request_id] = (tail[0], None, tail[2])
                return blocks, min(tail[0] * self.block_size + tail[1], request.num_tokens - 1)
            num_hit += found
        elif use_tier and num_hit < max_blocks:
            num_hit += self.tier.lookup(block_hashes[num_hit:max_blocks])
        num_hit_tokens = num_hit * self.block_size
        if self.radix is not None:
            num_hit_tokens += self._radix_partial_hit(request, num_hit)
        return blocks, num_hit_tokens

    def _radix_parent(self, request: Request, position: int) -> object:
        """The radix tree's key of the prefix before block `position`."""
        return request.block_hashes[position - 1] if position else ("root", request.hash_salt)

    def _radix_partial_hit(self, request: Request, position: int) -> int:
        """Tokens of block `position` a cached block (or a finished request's last one)
        already holds, past the whole blocks found; remembers that block for the copy."""
        start = position * self.block_size
        limit = min(start + self.block_size, request.num_tokens - 1)
        if start >= limit:
            return 0
        src, n = self.radix.longest_match(self._radix_parent(request, position), request.all_token_ids[start:limit])
        if n:
            self._partial_src[request.request_id] = (position, src, None)
        return n

    def _longest_hybrid_hit(self, block_hashes: list[int]) -> int:
        """Most leading positions whose KV every group has cached where it will read
        it: a full-attention group every position, a sliding-window group only those in
        the window of the first token after the hit."""
        cached = self.block_pool.cached_block_hash_to_block
        hit = len(block_hashes)
        for i, h in enumerate(block_hashes):
            if any(group_block_key(h, g) not in cached for g in self.full_groups):
                hit = i
                break
        while hit > 0:  # shrink until every sliding group has its window's blocks
            missing = -1
            for g, w in self.sliding_groups:
                for i in range(hit - 1, first_block_in_window(hit * self.block_size, w, self.block_size) - 1, -1):
                    if group_block_key(block_hashes[i], g) not in cached:
                        missing = max(missing, i)
                        break
            if missing < 0:
                break
            hit = missing  # any longer hit would still need that position
        return hit

    def _hybrid_hit_blocks(self, block_hashes: list[int], num_hit: int) -> list[KVCacheBlock]:
        cached, null = self.block_pool.cached_block_hash_to_block, self.block_pool.null_block
        firsts = [0 if w is None else first_block_in_window(num_hit * self.block_size, w, self.block_size)
                  for w in self.group_windows]
        return [cached[group_block_key(block_hashes[i], g)] if i >= first else null
                for i in range(num_hit) for g, first in enumerate(firsts)]

    # --------------------------------------------------------------- allocation
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_lookahead_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` more tokens after the computed ones.

        Layout of the request's tokens:  | computed | new_computed (cache hit) | new | lookahead |.
        Returns the newly allocated blocks (possibly empty; position-major over the
        groups), or None when the pool cannot supply them, changing nothing but the
        release of sliding-window blocks the request will never read again.
        """
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens must be > 0, got {num_new_tokens}")
        req_id = request.request_id
        req_blocks = self.req_to_blocks.get(req_id)
        pool = self.block_pool
        free_queue = pool.free_block_queue
        bs, num_groups = self.block_size, self.num_groups
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_tokens_need_slot = num_computed + num_new_tokens + num_lookahead_tokens
        if num_tokens_need_slot > self.max_model_len:
            num_tokens_need_slot = self.max_model_len
        num_required = (num_tokens_need_slot + bs - 1) // bs  # positions

        if req_blocks is not None and not new_computed_blocks:
            # A running request (the per-step hot path): only the tail may grow.
            if self.sliding_groups:
                self._release_out_of_window(req_id, req_blocks, request.num_computed_tokens)
            num_new_blocks = (num_required - len(req_blocks) // num_groups) * num_groups
            if num_new_blocks > 0:
                if num_new_blocks > free_queue.num_free_blocks:
                    return None
                new_blocks = pool.get_new_blocks(num_new_blocks)
                req_blocks.extend(new_blocks)
            else:
                new_blocks = []
        else:
            if req_blocks is None:
                req_blocks = []
            hits = new_computed_blocks or []
            num_new_blocks = num_required * num_groups - len(req_blocks) - len(hits)
            # Hit blocks nobody holds are counted as free; taking them costs free space.
            num_evictable = sum(1 for b in hits if b.ref_cnt == 0 and not b.is_null)
            if num_new_blocks + num_evictable > free_queue.num_free_blocks:
                return None
            if req_id not in self.req_to_blocks:  # the request is admitted: its lookup counts now
                self.req_to_blocks[req_id] = req_blocks
                self.num_cached_block[req_id] = 0
                if self.sliding_groups:
                    self.num_skipped_block[req_id] = 0
                if self.enable_caching:
                    self._record_prefix_lookup(request, num_new_computed_tokens)
            if hits:
                pool.touch(hits)
                req_blocks.extend(hits)
                self.num_cached_block[req_id] = len(req_blocks) // num_groups
                if self.sliding_groups:  # the hit's leading sliding positions are null already
                    self.num_skipped_block[req_id] = min(
                        first_block_in_window(num_computed, w, bs) for _, w in self.sliding_groups)
            new_blocks = pool.get_new_blocks(num_new_blocks) if num_new_blocks > 0 else []
            req_blocks.extend(new_blocks)
            if self.tier is not None or self.radix is not None:
                self._fill_hit(request, len(hits), num_computed, new_blocks)

        if self.enable_caching:
            # Register blocks that will be full once this step's tokens are computed.
            num_full = num_computed + num_new_tokens
            num_tokens = len(request.all_token_ids)
            num_full = (num_full if num_full < num_tokens else num_tokens) // bs
            num_cached = self.num_cached_block[req_id]
            if num_full > num_cached:
                if len(request.block_hashes) < num_full:
                    self._hash_blocks(request, num_full)
                for g in range(num_groups):
                    pool.cache_full_blocks(req_blocks, request.block_hashes, num_cached, num_full, g, num_groups)
                self.num_cached_block[req_id] = num_full
                if self.tier is not None:
                    self._save_to_tier(req_blocks, request.block_hashes, num_cached, num_full)
                if self.radix is not None:
                    self._radix_insert(request, req_blocks, num_cached, num_full)
        return new_blocks

    def _radix_insert(self, request: Request, req_blocks: list[KVCacheBlock], start: int, end: int) -> None:
        """Blocks this request registered in the prefix cache at [start, end) become
        nodes once this step has computed them (see take_transfers)."""
        bs, hashes, tokens = self.block_size, request.block_hashes, request.all_token_ids
        for i in range(start, end):
            block = req_blocks[i]
            if block.block_hash == hashes[i]:
                self._radix_pending.append((self._radix_parent(request, i), block, hashes[i],
                                            tokens[i * bs:(i + 1) * bs]))

    # ------------------------------------------------------------------- tier
    def _fill_hit(self, request: Request, num_pool_hits: int, num_computed: int,
                  new_blocks: list[KVCacheBlock]) -> None:
        """The hit past the pool's whole blocks, into the first of the request's new
        blocks: whole blocks loaded from the tier, then a partly matched last block
        loaded from the tier (a swapped-out request's) or copied from the pool (radix)."""
        req_id = request.request_id
        tail = self.swapped.pop(req_id, None)
        partial = self._partial_src.pop(req_id, None)
        if self.tier is not None and (self.enable_caching or tail is not None):  # it was asked
            self.tier_queries += request.num_tokens - num_pool_hits * self.block_size
        # Whole blocks from the tier up to the block the lookup matched in part (a radix
        # match may fill it: a cached block the hash walk did not reach past a tier hit).
        end = num_computed // self.block_size if partial is None else partial[0]
        keys = request.block_hashes[num_pool_hits:end]
        loaded = len(keys) * self.block_size
        if partial is not None:
            _, src, key = partial
            if key is not None:
                keys.append(key)
                loaded = num_computed - num_pool_hits * self.block_size
            else:
                self._transfers.copies.append((src, new_blocks[len(keys)].block_id))
        if keys:
            self.tier.claim(keys)
            self._transfers.loads.extend((b.block_id, k) for b, k in zip(new_blocks, keys, strict=False))
            self.tier_hits += loaded

    def _save_to_tier(self, req_blocks: list[KVCacheBlock], block_hashes: list[BlockHash], start: int,
                      end: int) -> None:
        """Store-on-compute: blocks this request registered in the prefix cache at
        positions [start, end) go to the tier after the step (the canonical copy only:
        a block another request cached first is that request's to save)."""
        if not self.store_computed:
            return
        tier, saves = self.tier, self._transfers.saves
        for i in range(start, end):
            block, key = req_blocks[i], block_hashes[i]
            if block.block_hash == key and not tier.contains(key):
                saves.append((block.block_id, key))

    def _swap_out(self, request: Request) -> None:
        """Preemption in swap mode: copy the request's computed KV
        to the tier, blocks the tier lacks and the partly filled last one, so that it
        resumes by loading them.  A tier that cannot hold them drops the oldest entries
        or these (it stays bounded): whatever is missing then is recomputed."""
        blocks = self.req_to_blocks.get(request.request_id)
        if not blocks:
            return
        bs, num_computed = self.block_size, request.num_computed_tokens
        num_full = min(num_computed // bs, len(blocks))
        hashes = self._hash_blocks(request, num_full)
        out = self._transfers.swap_outs
        pending = {k for _, k in out}
        for i in range(num_full):
            if not self.tier.contains(hashes[i]) and hashes[i] not in pending:
                out.append((blocks[i].block_id, hashes[i]))
        partial = num_computed - num_full * bs
        if partial and num_full < len(blocks):
            tokens = request.all_token_ids[num_full * bs:num_computed]
            key = partial_block_key(hashes[num_full - 1] if num_full else None, tokens, request.hash_salt)
            out.append((blocks[num_full].block_id, key))
            self.swapped[request.request_id] = (num_full, partial, key)
        else:
            self.swapped[request.request_id] = (num_full, 0, None)

    def take_transfers(self) -> KVTransfers | None:
        """The step's copies between pool and tier (None: none), handed to the runner.
        Ends the schedule: the radix nodes it registered become matchable (a later
        step's copy runs after this step has written them)."""
        if self._radix_pending:
            for parent, block, key, tokens in self._radix_pending:
                if block.block_hash == key:  # (not handed out again meanwhile)
                    self.radix.insert(parent, block.block_id, tokens)
            self._radix_pending.clear()
        if not self._transfers:
            return None
        transfers, self._transfers = self._transfers, KVTransfers()
        return transfers

    def _release_out_of_window(self, req_id: str, req_blocks: list[KVCacheBlock], num_computed: int) -> None:
        """Give back, in each sliding-window group, the blocks before the window of the
        next token to compute, leaving the null block in their place (the runner never
        reads them: every backend starts a sliding layer's keys at its window).  They stay
        in the prefix cache until evicted."""
        skipped = self.num_skipped_block[req_id]
        bs, num_groups, null = self.block_size, self.num_groups, self.block_pool.null_block
        firsts = [(g, first_block_in_window(num_computed, w, bs)) for g, w in self.sliding_groups]
        upto = max(first for _, first in firsts)
        if upto <= skipped:
            return
        released = []
        for g, first in firsts:
            for i in range(skipped, first):
                j = i * num_groups + g
                block = req_blocks[j]
                if not block.is_null:
                    released.append(block)
                    req_blocks[j] = null
        self.block_pool.free_blocks(released)
        self.num_skipped_block[req_id] = min(first for _, first in firsts)

    def _record_prefix_lookup(self, request: Request, num_hit: int) -> None:
        """Prefix-cache statistics in tokens, once per admission; a resumption after
        preemption re-hitting its own freed blocks is not reuse, so it counts apart."""
        if request.num_preemptions == 0:
            self.prefix_cache_requests += 1
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_hit
        else:
            self.preempted_prefix_cache_queries += request.num_tokens
            self.preempted_prefix_cache_hits += num_hit

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so that when they are reused
        the shareable prefix blocks are evicted last."""
        self.swapped.pop(request.request_id, None)
        self._partial_src.pop(request.request_id, None)
        self._free_blocks(request)

    def preempt(self, request: Request) -> None:
        """Release a preempted request's blocks; in swap mode copy them out first."""
        if self.swap:
            self._swap_out(request)
        self._free_blocks(request)

    def _free_blocks(self, request: Request) -> None:
        req_id = request.request_id
        blocks = self.req_to_blocks.pop(req_id, None)
        self.num_cached_block.pop(req_id, None)
        self.num_skipped_block.pop(req_id, None)
        if not blocks:
            return
        if self.radix is not None:  # the partly filled last block stays matchable while it lasts
            position, n = divmod(request.num_computed_tokens, self.block_size)
            # (Its parent may be a block completed by accepted drafts, never hashed yet.)
            self._hash_blocks(request, position)
            if n and position < len(blocks) and blocks[position].block_hash is None:
                start = position * self.block_size
                self.radix.insert(self._radix_parent(request, position), blocks[position].block_id,
                                  request.all_token_ids[start:start + n])
        self.block_pool.free_blocks(reversed(blocks))

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def check_invariants(self) -> None:
        """Raise AssertionError naming the first broken invariant of the pool and the
        tables.  O(blocks); for tests (both scheduler state machines call it after every
        rule) and for a server that is idle (mini-sglang's integrity check).
          * the null block is block 0, is never free, held or cached;
          * the free queue holds exactly the blocks nobody holds, and its count is true;
          * a block's ref_cnt is the number of table entries naming it;
          * a table is whole positions of every group; null entries only lead a
            sliding-window group's table (released out-of-window blocks);
          * the prefix cache maps each key to a block carrying that key, and a block
            shared by several tables is the cached one of its key;
          * radix nodes are blocks nobody writes into: free ones or cached ones;
          * a swapped-out request holds no blocks."""
        pool = self.block_pool

        def require(ok: bool, what: str) -> None:
            if not ok:
                raise AssertionError(f"KV-cache invariant broken: {what}")

        null = pool.null_block
        require(null is pool.blocks[0] and null.is_null and null.block_hash is None, "block 0 is the null block")
        free = pool.free_block_queue.get_all_free_blocks()
        require(len(free) == pool.get_num_free_blocks(), f"free queue has {len(free)} blocks, counts "
                f"{pool.get_num_free_blocks()}")
        free_ids = {b.block_id for b in free}
        require(len(free_ids) == len(free) and null.block_id not in free_ids, "free queue repeats a block or "
                "holds the null block")
        holders: dict[int, int] = {}
        for req_id, blocks in self.req_to_blocks.items():
            require(len(blocks) % self.num_groups == 0, f"{req_id}'s table is not whole positions")
            require(req_id not in self.swapped, f"swapped-out {req_id} still holds blocks")
            for g in range(self.num_groups):
                table = blocks[g::self.num_groups]
                nulls = sum(1 for b in table if b.is_null)
                require(nulls == 0 or (self.group_windows[g] is not None and all(b.is_null for b in table[:nulls])),
                        f"{req_id}'s group {g} has null blocks that are not released leading positions")
            for b in blocks:
                if not b.is_null:
                    holders[b.block_id] = holders.get(b.block_id, 0) + 1
        for b in pool.blocks[1:]:
            require(b.ref_cnt == holders.get(b.block_id, 0), f"{b} is held by {holders.get(b.block_id, 0)} tables")
            require((b.ref_cnt == 0) == (b.block_id in free_ids), f"{b} is {'' if b.block_id in free_ids else 'not '}"
                    "in the free queue")
            if b.ref_cnt > 1:
                require(b.block_hash is not None and pool.get_cached_block(b.block_hash) is b,
                        f"{b} is shared but is not the cached block of its key")
        for key, b in pool.cached_block_hash_to_block.items():
            require(b.block_hash == key and not b.is_null, f"{b} is cached under a key it does not carry")
        if self.radix is not None:
            for block_id, parent in self.radix.parent_of.items():
                b = pool.blocks[block_id]
                require(block_id in self.radix.children.get(parent, {}), f"radix node {block_id} is not its "
                        "parent's child")
                require(b.ref_cnt == 0 or b.block_hash is not None, f"radix node {b} is being written")

    def blocks_needed(self, num_tokens: int, max_step_tokens: int) -> int:
        """Most blocks a request of `num_tokens` KV slots holds at once (max_blocks_held)."""
        return max_blocks_held(num_tokens, self.block_size, self.group_windows, max_step_tokens)

    def can_ever_fit(self, num_tokens: int, max_step_tokens: int | None = None) -> bool:
        """Whether a sequence of num_tokens KV slots fits in the whole pool at once
        (`max_step_tokens`: the most a step computes; None counts every token)."""
        return self.blocks_needed(num_tokens, max_step_tokens or num_tokens) <= self.num_blocks - 1

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
"""

from __future__ import annotations

from pagedserve.core.block_pool import BlockPool, KVCacheBlock, group_block_key
from pagedserve.core.kv_cache_utils import extend_block_hashes
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
                 group_windows: tuple[int | None, ...] = (None,)) -> None:
        """`group_windows`: each KV-cache group's sliding window in tokens (None: full
        attention); the executor reports them with the pool's size."""
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
            request.block_hashes, request.all_token_ids, self.block_size, num_full_blocks, request.cache_salt
        )

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of the request, in whole blocks.

        Capped at num_tokens - 1: the last token is always recomputed because its
        logits are what the next sample needs.  Takes no references and changes
        nothing (a request stuck at the head of the queue is looked up every step);
        pass the result to allocate_slots in the same step, which counts the hit.
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0  # prompt logprobs need every prompt token computed
        block_hashes = self._hash_blocks(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        cached = self.block_pool.cached_block_hash_to_block
        if not self.sliding_groups:  # one full-attention group: the plain prefix walk
            blocks: list[KVCacheBlock] = []
            for block_hash in block_hashes[:max_blocks]:
                block = cached.get(block_hash)
                if block is None:
                    break
                blocks.append(block)
            return blocks, len(blocks) * self.block_size
        num_hit = self._longest_hybrid_hit(block_hashes[:max_blocks])
        return self._hybrid_hit_blocks(block_hashes, num_hit), num_hit * self.block_size

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
        return new_blocks

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
        req_id = request.request_id
        blocks = self.req_to_blocks.pop(req_id, None)
        self.num_cached_block.pop(req_id, None)
        self.num_skipped_block.pop(req_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def blocks_needed(self, num_tokens: int, max_step_tokens: int) -> int:
        """Most blocks a request of `num_tokens` KV slots holds at once (max_blocks_held)."""
        return max_blocks_held(num_tokens, self.block_size, self.group_windows, max_step_tokens)

    def can_ever_fit(self, num_tokens: int, max_step_tokens: int | None = None) -> bool:
        """Whether a sequence of num_tokens KV slots fits in the whole pool at once
        (`max_step_tokens`: the most a step computes; None counts every token)."""
        return self.blocks_needed(num_tokens, max_step_tokens or num_tokens) <= self.num_blocks - 1

"""Per-request block tables on top of the BlockPool, with prefix caching.

The scheduler speaks tokens; this class turns token counts into blocks.  A
request's table only grows while it runs and is dropped whole when it finishes
or is preempted.  Full blocks are registered in the prefix cache as soon as they
are allocated for tokens that this step will compute, so a request admitted later
in the same step (an n>1 sibling) already shares them: the runner writes a step's
new KV before any attention reads it, layer by layer.
"""

from __future__ import annotations

from pagedserve.core.block_pool import BlockPool, KVCacheBlock
from pagedserve.core.kv_cache_utils import extend_block_hashes
from pagedserve.core.request import Request
from pagedserve.utils import cdiv


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, max_model_len: int, enable_caching: bool = True) -> None:
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        if not isinstance(max_model_len, int) or max_model_len < 1:
            raise ValueError(f"max_model_len must be a positive integer, got {max_model_len!r}")
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.num_blocks = num_blocks
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are registered in the prefix cache.
        self.num_cached_block: dict[str, int] = {}
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
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

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
        blocks: list[KVCacheBlock] = []
        for block_hash in block_hashes[:max_blocks]:
            block = cached.get(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

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
        Returns the newly allocated blocks (possibly empty), or None, changing
        nothing, when the pool cannot supply them.
        """
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens must be > 0, got {num_new_tokens}")
        req_id = request.request_id
        req_blocks = self.req_to_blocks.get(req_id)
        pool = self.block_pool
        free_queue = pool.free_block_queue
        bs = self.block_size
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_tokens_need_slot = num_computed + num_new_tokens + num_lookahead_tokens
        if num_tokens_need_slot > self.max_model_len:
            num_tokens_need_slot = self.max_model_len
        num_required = (num_tokens_need_slot + bs - 1) // bs

        if req_blocks is not None and not new_computed_blocks:
            # A running request (the per-step hot path): only the tail may grow.
            num_new_blocks = num_required - len(req_blocks)
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
            num_new_blocks = num_required - len(req_blocks) - len(hits)
            # Hit blocks nobody holds are counted as free; taking them costs free space.
            num_evictable = sum(1 for b in hits if b.ref_cnt == 0)
            if num_new_blocks + num_evictable > free_queue.num_free_blocks:
                return None
            if req_id not in self.req_to_blocks:  # the request is admitted: its lookup counts now
                self.req_to_blocks[req_id] = req_blocks
                self.num_cached_block[req_id] = 0
                if self.enable_caching:
                    self._record_prefix_lookup(request, num_new_computed_tokens)
            if hits:
                pool.touch(hits)
                req_blocks.extend(hits)
                self.num_cached_block[req_id] = len(req_blocks)
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
                pool.cache_full_blocks(req_blocks, request.block_hashes, num_cached, num_full)
                self.num_cached_block[req_id] = num_full
        return new_blocks

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
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether a sequence of num_tokens KV slots fits in the whole pool at once."""
        return cdiv(num_tokens, self.block_size) <= self.num_blocks - 1

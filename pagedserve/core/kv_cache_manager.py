"""Per-request block tables on top of the BlockPool, with prefix caching: what the
scheduler sees of the KV cache.

The scheduler speaks tokens; this class turns token counts into blocks, validates the
configuration, counts the prefix-cache statistics and hands the rest to the
KV-cache coordinator (core/kv_cache_coordinator.py).  A request's table only grows
while it runs and is dropped whole when it finishes or is preempted.  Full blocks
are registered in the prefix cache as soon as they are allocated for tokens that
this step will compute, so a request admitted later in the same step (an n>1
sibling) already shares them: the runner writes a step's new KV before any
attention reads it, layer by layer.

KV-cache groups (vLLM v1's hybrid cache): a model whose layers do not all attend
over the whole context (Gemma 3's sliding-window layers beside its global ones) has
its layers split into groups of one attention type each, every group with its own
blocks for the same token positions, all drawn from the one pool (the worker makes
a block hold the same number of layers in every group).  Each group's tables are
kept by a manager of its type (core/single_type_kv_cache_manager.py); what leaves
this class is position-major: the block of position i for group g is
`blocks[i * num_groups + g]`.  A model with one full-attention group (every dense
model) has tables of one block per position.

Beneath the pool an optional tier (core/kv_tier.py, decided on by
core/kv_tier_connector.py) keeps blocks past their eviction and, in swap mode,
preempted requests' KV; the radix tree (core/radix_matcher.py) matches token by
token after the hash chain's last whole block.  Both are collaborators of the
coordinator, for a model of one KV-cache group.
"""

from __future__ import annotations

from collections.abc import Mapping

from pagedserve.core.block_pool import BlockPool, KVCacheBlock
from pagedserve.core.kv_cache_coordinator import KVCacheCoordinator, KVConnector
from pagedserve.core.kv_tier import KVTier, KVTransfers
from pagedserve.core.kv_tier_connector import SwappedTail, TierConnector
from pagedserve.core.radix_index import RadixIndex
from pagedserve.core.radix_matcher import RadixMatcher
from pagedserve.core.request import Request
from pagedserve.core.single_type_kv_cache_manager import max_blocks_held

__all__ = ["KVCacheManager", "max_blocks_held"]


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
        if swap and tier is None:
            raise ValueError("swap preemption needs a KV tier to swap to")
        if tier is not None and self.sliding_groups:
            raise ValueError("a KV tier (kv_offload_dir, kv_offload_bytes, preemption_mode='swap') is not supported "
                             "yet for models with sliding-window layers")
        if radix and (self.sliding_groups or not enable_caching):
            raise ValueError("prefix_caching_algo='radix' needs prefix caching and a model without sliding-window "
                             "layers")
        self.tier = tier
        self.swap = swap
        self.store_computed = tier is not None and store_computed
        self.tier_connector = (TierConnector(tier, block_size, enable_caching, swap, self.store_computed)
                               if tier is not None else None)
        self.radix_matcher = RadixMatcher(self.block_pool, block_size) if radix else None
        # The tier is asked before the radix tree: the tree's partial block follows the
        # tier's whole ones.
        connectors: list[KVConnector] = [c for c in (self.tier_connector, self.radix_matcher) if c is not None]
        self.coordinator = KVCacheCoordinator(self.block_pool, block_size, self.group_windows, enable_caching,
                                              connectors)
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

    @property
    def radix(self) -> RadixIndex | None:
        """The radix tree (prefix_caching_algo="radix"; None: the hash chain only)."""
        return self.radix_matcher.index if self.radix_matcher is not None else None

    @property
    def swapped(self) -> Mapping[str, SwappedTail]:
        """Swap mode: each swapped-out request's last block in the tier, until it resumes or ends."""
        return self.tier_connector.swapped if self.tier_connector is not None else {}

    @property
    def tier_queries(self) -> int:
        """Tokens asked of the tier past the pool's hit, every admission."""
        return self.tier_connector.num_queries if self.tier_connector is not None else 0

    @property
    def tier_hits(self) -> int:
        """Tokens loaded from the tier, every admission."""
        return self.tier_connector.num_hits if self.tier_connector is not None else 0

    @property
    def req_to_blocks(self) -> dict[str, list[KVCacheBlock]]:
        """Each request's blocks, position-major over the groups (a copy: for tests and
        people; the scheduler asks get_block_ids)."""
        coordinator = self.coordinator
        return {req_id: coordinator.get_blocks(req_id) for req_id in coordinator.request_ids()}

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block ids, position-major over the groups (0: a released
        sliding-window block, never read)."""
        return self.coordinator.get_block_ids(request_id)

    def num_held_blocks(self, request_id: str, group: int) -> int:
        """Blocks (not null) the request holds in one KV-cache group."""
        return self.coordinator.managers[group].num_held_blocks(request_id)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of the request: whole blocks from the pool, then
        whole blocks (and, for a request swapped out, its partly filled last block)
        from the tier, then part of a block through the radix tree; returns the pool's
        blocks (position-major) and the tokens of the whole hit.

        Capped at num_tokens - 1: the last token is always recomputed because its
        logits are what the next sample needs.  Takes no references and changes
        nothing (a request stuck at the head of the queue is looked up every step);
        pass the result to allocate_slots in the same step, which counts the hit and
        loads what lies beyond the pool.
        """
        if request.needs_every_prompt_state:
            return [], 0
        return self.coordinator.get_computed_blocks(request)

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
        coordinator, bs = self.coordinator, self.block_size
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_tokens_need_slot = min(num_computed + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        num_required = (num_tokens_need_slot + bs - 1) // bs  # positions
        if new_computed_blocks or not coordinator.has_request(request.request_id):
            new_blocks = self._admit(request, num_required, num_new_computed_tokens, new_computed_blocks or [])
        else:  # a running request (the per-step hot path): only the tail may grow
            new_blocks = coordinator.allocate_running(request, num_required)
        if new_blocks is not None and self.enable_caching:
            # Register blocks that will be full once this step's tokens are computed.
            coordinator.cache_blocks(request, min(num_computed + num_new_tokens, request.num_tokens) // bs)
        return new_blocks

    def _admit(self, request: Request, num_required: int, num_hit_tokens: int,
               hits: list[KVCacheBlock]) -> list[KVCacheBlock] | None:
        """A waiting request gets its hit and fresh blocks; its lookup counts in the
        statistics once it is admitted."""
        admitted = not self.coordinator.has_request(request.request_id)
        new_blocks = self.coordinator.allocate_with_hit(request, num_required, hits,
                                                        request.num_computed_tokens + num_hit_tokens)
        if new_blocks is not None and admitted and self.enable_caching:
            self._record_prefix_lookup(request, num_hit_tokens)
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

    def take_transfers(self) -> KVTransfers | None:
        """The step's copies between pool and tier (None: none), handed to the runner.
        Ends the schedule: the radix nodes it registered become matchable (a later
        step's copy runs after this step has written them)."""
        return self.coordinator.take_transfers()

    # --------------------------------------------------------------------- free
    def free(self, request: Request, keep_computed: bool = True) -> None:
        """Release the request's blocks, tail first, so that when they are reused
        the shareable prefix blocks are evicted last.  `keep_computed` (False: its KV
        is not what its hashes will say, a LongRoPE restart): see `_cache_computed`."""
        if keep_computed:
            self._cache_computed(request)
        self.coordinator.free(request)

    def preempt(self, request: Request) -> None:
        """Release a preempted request's blocks; in swap mode copy them out first."""
        self._cache_computed(request)
        self.coordinator.free(request, preempted=True)

    def _cache_computed(self, request: Request) -> None:
        """Register every full block of computed tokens before the blocks go back.
        `allocate_slots` registers blocks of known tokens only, so a block that the last
        step's accepted drafts filled would be freed unregistered, and the follow-up turn
        or the resumption recomputed it (speculation on cached one block less).  The pool
        only: the tier would save them after the next step, which may have rewritten them
        (the radix tree matches full blocks through the pool)."""
        if self.enable_caching and self.coordinator.has_request(request.request_id):
            num_full = min(request.num_computed_tokens, request.num_tokens) // self.block_size
            self.coordinator.cache_blocks(request, num_full, tell_connectors=False)

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def check_invariants(self) -> None:
        """Raise AssertionError naming the first broken invariant of the tables, the
        pool, the tier's swap state and the radix tree.  O(blocks); for tests (both
        scheduler state machines call it after every rule) and for a server that is
        idle (mini-sglang's integrity check).
          * every group's tables are whole positions of the admitted requests; null
            entries only lead a sliding-window group's table (released out-of-window
            blocks) (KVCacheCoordinator, SingleTypeKVCacheManager);
          * the null block is block 0, is never free, held or cached; the free queue
            holds exactly the blocks nobody holds, and its count is true; a block's
            ref_cnt is the number of table entries naming it; the prefix cache maps
            each key to a block carrying that key, and a block shared by several
            tables is the cached one of its key (BlockPool);
          * a swapped-out request holds no blocks (TierConnector);
          * radix nodes are blocks nobody writes into: free ones or cached ones
            (RadixMatcher)."""
        self.coordinator.check_invariants()

    def blocks_needed(self, num_tokens: int, max_step_tokens: int) -> int:
        """Most blocks a request of `num_tokens` KV slots holds at once (max_blocks_held)."""
        return max_blocks_held(num_tokens, self.block_size, self.group_windows, max_step_tokens)

    def can_ever_fit(self, num_tokens: int, max_step_tokens: int | None = None) -> bool:
        """Whether a sequence of num_tokens KV slots fits in the whole pool at once
        (`max_step_tokens`: the most a step computes; None counts every token)."""
        return self.blocks_needed(num_tokens, max_step_tokens or num_tokens) <= self.num_blocks - 1

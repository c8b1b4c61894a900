"""SGLang's radix tree over the block pool (prefix_caching_algo="radix").

The hash chain finds a request's longest cached prefix in whole blocks: a shared
prefix that ends mid-block, or a conversation whose last turn ended mid-block, loses
up to block_size - 1 tokens of reuse at every lookup.  The radix tree keeps matching
token by token: its nodes are blocks, a node's children are the blocks that followed
its prefix (keyed by the parent's prefix-cache key, so the full-block part of the
walk is still the hash chain's), each with the tokens it holds.  After the chain's
last full hit, the child sharing the longest run of the request's next tokens gives
a partial hit: its KV is copied into the request's own block (copy-on-write), and
the request computes from the first token that differs.

Children are full blocks registered in the prefix cache and the partly filled last
blocks of finished requests (their KV is valid up to the tokens they hold).  A node
lives exactly as long as its block keeps its contents: the pool drops it when it
hands the block out again (least recently used first, leaves before their parents
since requests free tail first), and a block in use is never handed out.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class RadixIndex:
    def __init__(self) -> None:
        # parent prefix key -> {block id: the tokens that block holds after that prefix}
        self.children: dict[Hashable, dict[int, tuple[int, ...]]] = {}
        self.parent_of: dict[int, Hashable] = {}  # block id -> its parent's key

    def __len__(self) -> int:
        return len(self.parent_of)

    def insert(self, parent: Hashable, block_id: int, tokens: Sequence[int]) -> None:
        """Register (or re-register) a block as a child of `parent`."""
        self.remove(block_id)
        self.children.setdefault(parent, {})[block_id] = tuple(tokens)
        self.parent_of[block_id] = parent

    def remove(self, block_id: int) -> None:
        """The block is handed out again: its node goes (a no-op if it has none)."""
        parent = self.parent_of.pop(block_id, None)
        if parent is None:
            return
        kids = self.children[parent]
        del kids[block_id]
        if not kids:
            del self.children[parent]

    def longest_match(self, parent: Hashable, tokens: Sequence[int]) -> tuple[int, int]:
        """(block id, tokens matched) of the child of `parent` sharing the longest run of
        `tokens`; (0, 0) when none shares the first."""
        best, best_n = 0, 0
        for block_id, held in self.children.get(parent, {}).items():
            n = common_prefix_len(held, tokens)
            if n > best_n:
                best, best_n = block_id, n
        return best, best_n

    def clear(self) -> None:
        self.children.clear()
        self.parent_of.clear()

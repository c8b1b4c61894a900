"""Token-id prompts shared by the end-to-end parity tests (HF parity, tp=2 vs tp=1)."""

from __future__ import annotations

import random


def shared_prefix_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    """8 token-id prompts of 5..70 tokens; the odd ones share a 40-token prefix, so the
    prefix cache really hits while both are running or after one finished."""
    rng = random.Random(seed)
    common = [rng.randrange(3, vocab) for _ in range(40)]
    out = []
    for i in range(8):
        tail = [rng.randrange(3, vocab) for _ in range(rng.randint(5, 30))]
        out.append(common + tail if i % 2 else [rng.randrange(3, vocab) for _ in range(rng.randint(5, 70))])
    return out

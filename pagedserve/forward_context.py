"""The per-step context that attention layers read, as nano-vllm's `Context` does.

Model code takes only (input_ids, positions); everything attention needs for this
step (metadata built once by the runner) travels here instead of through every
layer's signature.  This is the one module-level state the engine keeps, and it is
per thread: a server of several models steps each model's engine on its own thread at
once (a shared global had one model's attention read another's metadata: wrong tokens,
then a dead engine).

`modules` serves torch.compile (worker/compiled_model.py): a compiled graph calls a
layer's eager code through a custom op that can carry only tensors and numbers, so
the op names the layer by its index in this list (layers/opaque.py).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class BidirectionalSpan:
    """An image whose tokens attend to each other both ways (Gemma 3's prompts): this
    step's query rows [q_start, q_end) belong to request `request_index` of the step and
    lie in its span of positions [start, end), all of whose keys are in the cache once
    this step's are written (the scheduler never splits such a span across chunks)."""

    request_index: int
    q_start: int
    q_end: int
    start: int
    end: int


@dataclass
class ForwardContext:
    # The backend's metadata for this step, one per KV-cache group (a layer reads its
    # group's: worker/kv_cache.py); None in a profile run.
    attn_metadata: Sequence[Any] | None
    modules: Sequence[Any] = ()  # layers a compiled graph calls back into, by index
    bidirectional: Sequence[BidirectionalSpan] = ()
    # The step's CommonAttentionMetadata per KV-cache group, when `bidirectional` has spans
    # (their keys are read back through its block table).
    common: Sequence[Any] = ()


class _ThreadContext(threading.local):
    context: ForwardContext | None = None  # this thread's step (the model it runs)


_LOCAL = _ThreadContext()


@contextmanager
def set_forward_context(attn_metadata: Sequence[Any] | None, modules: Sequence[Any] = (),
                        bidirectional: Sequence[BidirectionalSpan] = (), common: Sequence[Any] = ()) -> Iterator[None]:
    local = _LOCAL
    prev = local.context
    local.context = ForwardContext(attn_metadata, modules, bidirectional, common)
    try:
        yield
    finally:
        local.context = prev


def get_forward_context() -> ForwardContext:
    context = _LOCAL.context
    if context is None:
        raise RuntimeError("attention ran outside set_forward_context(): no metadata for this step")
    return context

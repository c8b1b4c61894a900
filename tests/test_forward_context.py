"""The per-step forward context is each thread's own: a server of several models steps
their engines on their own threads at once, and one model's attention must never read
another's metadata (it did through a module global: wrong tokens, then a dead engine)."""

from __future__ import annotations

import threading

import pytest

from pagedserve.forward_context import get_forward_context, set_forward_context


def test_two_engine_threads_each_read_their_own_step() -> None:
    both_set, both_read, read = threading.Barrier(2), threading.Barrier(2), {}

    def engine(name: str) -> None:
        with set_forward_context([name]):
            both_set.wait(5)  # the other thread has set its own step meanwhile
            read[name] = get_forward_context().attn_metadata
            both_read.wait(5)  # (neither leaves its step before both have read)

    threads = [threading.Thread(target=engine, args=(n,), name=n) for n in ("model-a", "model-b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert read["model-a"] == ["model-a"] and read["model-b"] == ["model-b"]
    with pytest.raises(RuntimeError, match="outside set_forward_context"):
        get_forward_context()  # (this thread never set one)


def test_nested_contexts_restore_the_outer_one() -> None:
    with set_forward_context(["outer"]):
        with set_forward_context(["inner"], modules=("m",)):
            assert get_forward_context().attn_metadata == ["inner"] and get_forward_context().modules == ("m",)
        assert get_forward_context().attn_metadata == ["outer"]

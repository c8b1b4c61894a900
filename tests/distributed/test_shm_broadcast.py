"""The shared-memory step channel, with the reader in a thread of this process."""

from __future__ import annotations

import multiprocessing
import threading

import pytest

from pagedserve.distributed.shm_broadcast import ShmBroadcaster, ShmReader


def _never() -> None:
    pass


def test_messages_arrive_in_order_and_the_segment_grows() -> None:
    ctx = multiprocessing.get_context("spawn")
    writer = ShmBroadcaster(2, ctx, capacity=4096)
    readers = [ShmReader(writer.reader_handle(i)) for i in range(2)]
    got: list[list] = [[], []]

    def read(i: int) -> None:
        while True:
            msg = readers[i].receive(_never, poll_s=0.05)
            if msg is None:
                return
            got[i].append(msg)

    threads = [threading.Thread(target=read, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    sent = [("step", i, list(range(i % 7))) for i in range(200)]
    sent.insert(100, ("big", list(range(20000))))  # far past 4 KiB: the channel moves
    for msg in sent:
        writer.broadcast(msg, _never, timeout_s=10)
    writer.broadcast(None, _never, timeout_s=10)
    for t in threads:
        t.join(10)
    assert got == [sent, sent]
    for r in readers:
        r.close()
    writer.close()


def test_writer_wait_raises_when_a_reader_is_gone() -> None:
    ctx = multiprocessing.get_context("spawn")
    writer = ShmBroadcaster(1, ctx)
    writer.broadcast("first", _never, timeout_s=1)  # nobody reads it

    def dead() -> None:
        raise RuntimeError("rank 1 died")

    with pytest.raises(RuntimeError, match="rank 1 died"):
        writer.broadcast("second", dead, timeout_s=5)
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[1\] did not take step input"):
        writer.broadcast("second", _never, timeout_s=0.2)
    writer.close()


def test_reader_wait_runs_the_check() -> None:
    ctx = multiprocessing.get_context("spawn")
    writer = ShmBroadcaster(1, ctx)
    reader = ShmReader(writer.reader_handle(0))

    class Gone(Exception):
        pass

    def parent_gone() -> None:
        raise Gone

    with pytest.raises(Gone):
        reader.receive(parent_gone, poll_s=0.01)
    reader.close()
    writer.close()

"""One writer (rank 0) to N-1 readers (the workers): one pickled message per step in shared memory.

Rank 0 pickles a message (per step: the SchedulerOutput) once into a shared-memory
segment, bumps a sequence number and posts one semaphore per reader.  A reader wakes,
unpickles straight from the segment and writes the sequence number into its own
ack slot.  The writer overwrites the payload only after every reader acked the
previous message, so nobody can read a half-written step, and ordering never
leans on the model's collectives (an empty step has none).  A message bigger than
the segment moves the channel to a larger segment (its name is sent first).

Layout: [seq u64][nbytes u64][ack u64 per reader][pad to 64][payload].
Every wait takes a `check` callable that raises when the other side is gone, so a
dead peer is an error within one poll interval, never a hang.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any

from pagedserve.utils import cdiv

_U64 = 8
_DEFAULT_CAPACITY = 1 << 22  # 4 MiB: a step with thousands of new prompt tokens fits


def _payload_offset(num_readers: int) -> int:
    return cdiv((2 + num_readers) * _U64, 64) * 64


def _get(buf: memoryview, offset: int) -> int:
    return int.from_bytes(buf[offset:offset + _U64], "little")


def _put(buf: memoryview, offset: int, value: int) -> None:
    buf[offset:offset + _U64] = value.to_bytes(_U64, "little")


@dataclass
class _Move:
    """Control message: the channel continues in segment `name`."""

    name: str


@dataclass
class ReaderHandle:
    """What a reader needs; picklable, so it travels in the worker's spawn arguments."""

    name: str
    index: int
    num_readers: int
    wakeup: Any  # multiprocessing Semaphore of this reader, posted once per message


class ShmBroadcaster:
    def __init__(self, num_readers: int, mp_context: Any, capacity: int = _DEFAULT_CAPACITY) -> None:
        self.num_readers = num_readers
        # A semaphore post is one syscall; Event.set() waits for the sleeper to wake (~0.3 ms).
        self.wakeups = [mp_context.Semaphore(0) for _ in range(num_readers)]
        self._offset = _payload_offset(num_readers)
        self._seq = 0
        self._shm = self._create(capacity, 0)

    def _create(self, size: int, seq: int) -> shared_memory.SharedMemory:
        shm = shared_memory.SharedMemory(create=True, size=size)
        _put(shm.buf, 0, seq)
        _put(shm.buf, _U64, 0)
        for i in range(self.num_readers):
            _put(shm.buf, (2 + i) * _U64, seq)
        return shm

    def reader_handle(self, index: int) -> ReaderHandle:
        return ReaderHandle(self._shm.name, index, self.num_readers, self.wakeups[index])

    def broadcast(self, obj: Any, check: Callable[[], None], timeout_s: float) -> None:
        """Send `obj` to every reader (returns once written, not once read)."""
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        self.wait_acks(check, timeout_s)
        if self._offset + len(data) > self._shm.size:
            new = self._create(max(2 * self._shm.size, 2 * (self._offset + len(data))), self._seq + 1)
            self._write(pickle.dumps(_Move(new.name)))
            self.wait_acks(check, timeout_s)
            self._close(self._shm)
            self._shm = new
        self._write(data)

    def _write(self, data: bytes) -> None:
        buf = self._shm.buf
        buf[self._offset:self._offset + len(data)] = data
        _put(buf, _U64, len(data))
        self._seq += 1
        _put(buf, 0, self._seq)  # last: a reader that sees the new seq sees the whole payload
        del buf
        for wakeup in self.wakeups:
            wakeup.release()

    def wait_acks(self, check: Callable[[], None], timeout_s: float) -> None:
        """Block until every reader has taken the last message."""
        buf, deadline, spins = self._shm.buf, time.monotonic() + timeout_s, 0
        try:
            while any(_get(buf, (2 + i) * _U64) != self._seq for i in range(self.num_readers)):
                check()
                if time.monotonic() > deadline:
                    slow = [i + 1 for i in range(self.num_readers) if _get(buf, (2 + i) * _U64) != self._seq]
                    raise TimeoutError(f"tensor-parallel rank(s) {slow} did not take step input "
                                       f"within {timeout_s:.0f} s")
                spins += 1
                time.sleep(0 if spins < 100 else 1e-4)
        finally:
            del buf

    @staticmethod
    def _close(shm: shared_memory.SharedMemory) -> None:
        try:
            shm.unlink()
        except FileNotFoundError:
            pass
        shm.close()

    def close(self) -> None:
        if self._shm is not None:
            self._close(self._shm)
            self._shm = None


class ShmReader:
    def __init__(self, handle: ReaderHandle) -> None:
        # Attaching registers the name with the resource tracker that spawned children
        # share with rank 0; the tracker keeps a set, so rank 0's unlink still clears it.
        self._shm = shared_memory.SharedMemory(name=handle.name)
        self._ack = (2 + handle.index) * _U64
        self._offset = _payload_offset(handle.num_readers)
        self._wakeup = handle.wakeup
        self._seq = _get(self._shm.buf, self._ack)

    def receive(self, check: Callable[[], None], poll_s: float = 0.5) -> Any:
        """The next message; `check` runs every `poll_s` while waiting (and raises to stop)."""
        while True:
            while _get(self._shm.buf, 0) == self._seq:  # a post may be left from a message read early
                if not self._wakeup.acquire(timeout=poll_s):
                    check()
            buf = self._shm.buf
            n = _get(buf, _U64)
            obj = pickle.loads(buf[self._offset:self._offset + n])
            self._seq += 1
            _put(buf, self._ack, self._seq)
            del buf
            if not isinstance(obj, _Move):
                return obj
            self._shm.close()
            self._shm = shared_memory.SharedMemory(name=obj.name)

    def close(self) -> None:
        self._shm.close()

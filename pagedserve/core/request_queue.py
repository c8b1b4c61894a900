"""The waiting queue, in the two orders the scheduler supports.

FCFS is a deque: arrivals at the tail (after the last that arrived no later: a beam
search's steps keep the search's arrival), preempted requests back at the head so they
resume before anything newer.  Priority is a heap on (priority, arrival_time,
admission sequence): lower priority value first, as in vLLM, and a preempted
request needs no special place because its key already says where it belongs.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator

from pagedserve.core.request import Request


class FCFSRequestQueue(deque):
    def add_request(self, request: Request) -> None:
        """At the tail, unless requests waiting there arrived after it: then before them.
        A beam search's next step is a new request that arrived with the search (its
        steps each went behind every later arrival: under steady load the search that came
        first finished last); one prepared while later ones were (a long prompt to
        tokenize, a grammar to compile) keeps its place too.  Arrivals are near-monotonic,
        so the scan from the tail stops at once."""
        later = 0
        for waiting in reversed(self):
            if waiting.arrival_time <= request.arrival_time:
                break
            later += 1
        if later:
            self.insert(len(self) - later, request)
        else:
            self.append(request)

    def prepend_request(self, request: Request) -> None:
        self.appendleft(request)

    def peek_request(self) -> Request:
        return self[0]

    def pop_request(self) -> Request:
        return self.popleft()

    def remove_request(self, request: Request) -> None:
        self.remove(request)


class PriorityRequestQueue:
    def __init__(self) -> None:
        self._heap: list[tuple[tuple, Request]] = []

    def add_request(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.sched_key, request))

    prepend_request = add_request

    def peek_request(self) -> Request:
        if not self._heap:
            raise IndexError("peek from an empty queue")
        return self._heap[0][1]

    def pop_request(self) -> Request:
        if not self._heap:
            raise IndexError("pop from an empty queue")
        return heapq.heappop(self._heap)[1]

    def remove_request(self, request: Request) -> None:
        for i, (_, req) in enumerate(self._heap):
            if req is request:
                last = self._heap.pop()
                if i < len(self._heap):
                    self._heap[i] = last
                    heapq.heapify(self._heap)
                return
        raise ValueError(f"request {request.request_id!r} is not in the waiting queue")

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (req for _, req in sorted(self._heap, key=lambda e: e[0]))


def create_request_queue(policy: str) -> FCFSRequestQueue | PriorityRequestQueue:
    """The queue for a policy SchedulerConfig has already checked."""
    return PriorityRequestQueue() if policy == "priority" else FCFSRequestQueue()

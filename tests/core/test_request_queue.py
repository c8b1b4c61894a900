"""The two waiting-queue orders the scheduler relies on."""

from __future__ import annotations

import pytest
from core_helpers import make_request

from pagedserve.core.request_queue import FCFSRequestQueue, PriorityRequestQueue, create_request_queue


def _req(rid: str, priority: int = 0, arrival: float = 0.0, seq: int = 0):
    r = make_request(rid, 3)
    r.sched_key = (priority, arrival, seq)
    return r


def test_fcfs_arrivals_at_the_tail_preempted_at_the_head():
    q = create_request_queue("fcfs")
    assert isinstance(q, FCFSRequestQueue) and not q
    a, b, c = _req("a"), _req("b"), _req("c")
    q.add_request(a)
    q.add_request(b)
    q.prepend_request(c)  # a preempted request resumes before anything newer
    assert q.peek_request() is c and [r.request_id for r in q] == ["c", "a", "b"]
    q.remove_request(a)
    assert [q.pop_request().request_id for _ in range(len(q))] == ["c", "b"]


def test_priority_orders_by_priority_then_arrival_then_admission():
    q = create_request_queue("priority")
    assert isinstance(q, PriorityRequestQueue) and not q
    reqs = [_req("late-urgent", 0, 5.0, 3), _req("early", 1, 1.0, 0), _req("tie-second", 1, 1.0, 2),
            _req("urgent", 0, 2.0, 1)]
    for r in reqs:
        q.add_request(r)
    assert [r.request_id for r in q] == ["urgent", "late-urgent", "early", "tie-second"]  # iteration: sorted
    q.prepend_request(_req("resumed", 0, 0.5, 9))  # its key alone says where it belongs
    assert q.peek_request().request_id == "resumed"
    q.remove_request(reqs[0])
    assert [q.pop_request().request_id for _ in range(len(q))] == ["resumed", "urgent", "early", "tie-second"]
    with pytest.raises(IndexError):
        q.peek_request()
    with pytest.raises(ValueError, match="not in the waiting queue"):
        q.remove_request(reqs[1])

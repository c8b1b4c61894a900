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


def test_fcfs_puts_an_earlier_arrival_before_the_later_ones_waiting():
    """A beam search's next step arrives with the search (its steps each went behind
    every later arrival); equal times keep their order, and a preempted request at the
    head stays there."""
    q = create_request_queue("fcfs")
    reqs = {rid: make_request(rid, 3) for rid in ("resumed", "a", "b", "c", "step", "tie")}
    for rid, t in (("resumed", 0.5), ("a", 1.0), ("b", 2.0), ("c", 3.0), ("step", 1.5), ("tie", 2.0)):
        reqs[rid].arrival_time = t
    q.prepend_request(reqs["resumed"])
    for rid in ("a", "b", "c", "step", "tie"):
        q.add_request(reqs[rid])
    assert [r.request_id for r in q] == ["resumed", "a", "step", "b", "tie", "c"]
    early = make_request("early", 3)
    early.arrival_time = 0.0
    q.add_request(early)  # (before the preempted one too, which arrived after it)
    assert [r.request_id for r in q][:2] == ["early", "resumed"]


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

"""Waiting queues: FCFS (arrival order, prepend at head) and PRIORITY ((priority, arrival_time) order)."""

from __future__ import annotations

import pytest

from kvflow.core.sched.request_queue import (
    FCFSRequestQueue,
    PriorityRequestQueue,
    SchedulingPolicy,
    create_request_queue,
)
from kvflow.request import Request
from kvflow.sampling_params import SamplingParams


def req(request_id: str, priority: int = 0, arrival_time: float = 0.0) -> Request:
    return Request(request_id, [1], SamplingParams(), priority=priority, arrival_time=arrival_time)


def ids(queue) -> list[str]:
    return [request.request_id for request in queue]


def pop_all(queue) -> list[str]:
    popped = []
    while queue:
        popped.append(queue.pop_request().request_id)
    return popped


# ------------------------------------------------------------------------------------------------ factory
def test_create_request_queue_by_policy():
    assert isinstance(create_request_queue(SchedulingPolicy.FCFS), FCFSRequestQueue)
    assert isinstance(create_request_queue(SchedulingPolicy.PRIORITY), PriorityRequestQueue)
    assert SchedulingPolicy("fcfs") is SchedulingPolicy.FCFS
    assert SchedulingPolicy("priority") is SchedulingPolicy.PRIORITY


# ------------------------------------------------------------------------------------------------ FCFS
def test_fcfs_pops_in_arrival_order_ignoring_priority():
    queue = FCFSRequestQueue()
    for request in (req("a", priority=5), req("b", priority=0), req("c", priority=1)):
        queue.add_request(request)
    assert len(queue) == 3
    assert queue.peek_request().request_id == "a"
    assert ids(queue) == ["a", "b", "c"]
    assert pop_all(queue) == ["a", "b", "c"]
    assert not queue and len(queue) == 0


def test_fcfs_peek_does_not_remove():
    queue = FCFSRequestQueue()
    queue.add_request(req("a"))
    assert queue.peek_request() is queue.peek_request()
    assert len(queue) == 1


def test_fcfs_peek_and_pop_empty_raise():
    queue = FCFSRequestQueue()
    with pytest.raises(IndexError):
        queue.peek_request()
    with pytest.raises(IndexError):
        queue.pop_request()


def test_fcfs_prepend_request_goes_to_head():
    queue = FCFSRequestQueue()
    queue.add_request(req("a"))
    queue.add_request(req("b"))
    queue.prepend_request(req("p"))
    assert ids(queue) == ["p", "a", "b"]


def test_fcfs_prepend_requests_keeps_their_order_at_head():
    queue = FCFSRequestQueue()
    queue.add_request(req("a"))
    others = FCFSRequestQueue()
    for request_id in ("x", "y", "z"):
        others.add_request(req(request_id))
    queue.prepend_requests(others)
    assert ids(queue) == ["x", "y", "z", "a"]


def test_fcfs_remove_requests_keeps_order_of_the_rest():
    queue = FCFSRequestQueue()
    requests = [req(request_id) for request_id in "abcde"]
    for request in requests:
        queue.add_request(request)
    queue.remove_requests([requests[1], requests[3]])
    assert ids(queue) == ["a", "c", "e"]
    queue.remove_requests([req("not-there")])
    assert ids(queue) == ["a", "c", "e"]
    queue.remove_requests([])
    assert len(queue) == 3


# ------------------------------------------------------------------------------------------------ PRIORITY
def test_priority_orders_by_priority_then_arrival():
    queue = PriorityRequestQueue()
    queue.add_request(req("late-high", priority=0, arrival_time=5.0))
    queue.add_request(req("low", priority=2, arrival_time=0.0))
    queue.add_request(req("early-high", priority=0, arrival_time=1.0))
    queue.add_request(req("mid", priority=1, arrival_time=0.5))
    assert queue.peek_request().request_id == "early-high"
    assert ids(queue) == ["early-high", "late-high", "mid", "low"]
    assert pop_all(queue) == ["early-high", "late-high", "mid", "low"]


def test_priority_ties_keep_insertion_order():
    queue = PriorityRequestQueue()
    for request_id in ("a", "b", "c"):
        queue.add_request(req(request_id, priority=1, arrival_time=2.0))
    assert pop_all(queue) == ["a", "b", "c"]


def test_priority_negative_priority_first():
    queue = PriorityRequestQueue()
    queue.add_request(req("zero", priority=0))
    queue.add_request(req("neg", priority=-1, arrival_time=9.0))
    assert queue.pop_request().request_id == "neg"


def test_priority_prepend_is_ordered_insert():
    queue = PriorityRequestQueue()
    queue.add_request(req("a", priority=0, arrival_time=1.0))
    queue.add_request(req("c", priority=2, arrival_time=1.0))
    queue.prepend_request(req("b", priority=1, arrival_time=0.0))
    assert ids(queue) == ["a", "b", "c"]
    others = PriorityRequestQueue()
    others.add_request(req("first", priority=-5))
    others.add_request(req("last", priority=9))
    queue.prepend_requests(others)
    assert ids(queue) == ["first", "a", "b", "c", "last"]


def test_priority_remove_requests():
    queue = PriorityRequestQueue()
    requests = [req(str(i), priority=i % 3, arrival_time=float(i)) for i in range(6)]
    for request in requests:
        queue.add_request(request)
    queue.remove_requests([requests[0], requests[4]])
    assert pop_all(queue) == ["3", "1", "2", "5"]


def test_priority_peek_empty_raises():
    with pytest.raises(IndexError):
        PriorityRequestQueue().peek_request()


def test_priority_iteration_does_not_consume():
    queue = PriorityRequestQueue()
    queue.add_request(req("b", priority=1))
    queue.add_request(req("a", priority=0))
    assert ids(queue) == ["a", "b"]
    assert len(queue) == 2
    assert bool(queue)

"""Waiting queues: FCFS (a deque) and PRIORITY (a heap on (priority, arrival_time))."""

from __future__ import annotations

import enum
import heapq
import itertools
from collections import deque
from collections.abc import Iterable, Iterator

from kvflow.request import Request


class SchedulingPolicy(enum.Enum):
    """Order of the waiting queue and choice of preemption victim: arrival order, or (priority, arrival)."""

    FCFS = "fcfs"
    PRIORITY = "priority"


class RequestQueue:
    """Interface of a waiting queue: add / peek / pop / prepend / remove, len, iteration in pop order."""

    def add_request(self, request: Request) -> None:
        raise NotImplementedError

    def pop_request(self) -> Request:
        raise NotImplementedError

    def peek_request(self) -> Request:
        raise NotImplementedError

    def prepend_request(self, request: Request) -> None:
        raise NotImplementedError

    def prepend_requests(self, requests: RequestQueue) -> None:
        raise NotImplementedError

    def remove_requests(self, requests: Iterable[Request]) -> None:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def __iter__(self) -> Iterator[Request]:
        raise NotImplementedError

    def __bool__(self) -> bool:
        return len(self) > 0


class FCFSRequestQueue(RequestQueue):
    """Arrival order; `prepend_request` puts a preempted request back at the head."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add_request(self, request: Request) -> None:
        self._queue.append(request)

    def pop_request(self) -> Request:
        return self._queue.popleft()

    def peek_request(self) -> Request:
        if not self._queue:
            raise IndexError("peek from an empty queue")
        return self._queue[0]

    def prepend_request(self, request: Request) -> None:
        self._queue.appendleft(request)

    def prepend_requests(self, requests: RequestQueue) -> None:
        # extendleft reverses its input. E.g., queue [x, y], prepend [a, b]: extendleft([b, a]) -> [a, b, x, y].
        self._queue.extendleft(reversed(list(requests)))

    def remove_requests(self, requests: Iterable[Request]) -> None:
        to_remove = set(requests)
        self._queue = deque(request for request in self._queue if request not in to_remove)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityRequestQueue(RequestQueue):
    """Lowest (priority, arrival_time) first; ties broken by insertion order. Prepending is just adding."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()

    def add_request(self, request: Request) -> None:
        heapq.heappush(
            self._heap, (request.priority, request.arrival_time, next(self._counter), request)
        )

    def pop_request(self) -> Request:
        return heapq.heappop(self._heap)[-1]

    def peek_request(self) -> Request:
        if not self._heap:
            raise IndexError("peek from an empty queue")
        return self._heap[0][-1]

    def prepend_request(self, request: Request) -> None:
        self.add_request(request)

    def prepend_requests(self, requests: RequestQueue) -> None:
        for request in requests:
            self.add_request(request)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        to_remove = set(requests)
        self._heap = [entry for entry in self._heap if entry[-1] not in to_remove]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[-1] for entry in sorted(self._heap))


def create_request_queue(policy: SchedulingPolicy) -> RequestQueue:
    if policy == SchedulingPolicy.PRIORITY:
        return PriorityRequestQueue()
    return FCFSRequestQueue()

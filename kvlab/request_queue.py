"""The waiting queue, and the scheduling policy that orders it (chapter 03).

vLLM keeps its waiting requests behind one small interface (`vllm/v1/core/sched/request_queue.py`:
`RequestQueue`, made by `create_request_queue(policy)`), so that the scheduler reads the same
whichever order the queue keeps: it `peek_request`s the head, `pop_request`s it once admitted,
`prepend_request`s a preempted request, `remove_request`s an aborted one. Two policies, vLLM's
`--scheduling-policy` (`vllm/config/scheduler.py`: `policy`, default "fcfs"):

- "fcfs": first come, first served. A deque in arrival order; a preempted request goes back to
  the front, so it is the next one admitted.
- "priority": the request with the lowest `priority` value first, ties by arrival time (and
  then by request id, as vLLM's `Request.__lt__` in `vllm/v1/request.py`). A heap. There is no
  front to prepend to: a preempted request goes back to its place in that order.

The policy also picks the preemption victim; that choice lives in the scheduler
(`kvlab/scheduler.py`), as in vLLM.
"""

from __future__ import annotations

import enum
import heapq
import itertools
from collections import deque
from collections.abc import Iterable, Iterator

from kvlab.request import Request


class SchedulingPolicy(enum.Enum):
    """vLLM's two policies (vllm/v1/core/sched/request_queue.py), by their config names."""

    FCFS = "fcfs"
    PRIORITY = "priority"


class RequestQueue:
    """What the scheduler asks of its waiting queue, whatever the policy."""

    def add_request(self, request: Request) -> None:
        """A new arrival (or a request sent back to wait), placed as the policy orders it."""
        raise NotImplementedError

    def pop_request(self) -> Request:
        """Take out the request the policy serves next."""
        raise NotImplementedError

    def peek_request(self) -> Request:
        """The request the policy serves next, left in the queue."""
        raise NotImplementedError

    def prepend_request(self, request: Request) -> None:
        """A preempted request back in the queue, ahead of the others where the policy allows."""
        raise NotImplementedError

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        for request in requests:
            self.prepend_request(request)

    def remove_request(self, request: Request) -> None:
        raise NotImplementedError

    def remove_requests(self, requests: Iterable[Request]) -> None:
        for request in list(requests):
            self.remove_request(request)


class FCFSRequestQueue(deque, RequestQueue):
    """Arrival order. A deque, so the deque calls that chapter 03's exercises and earlier code
    use (`append`, `popleft`, `[0]`, `remove`) keep working beside the queue's own names."""

    def add_request(self, request: Request) -> None:
        self.append(request)

    def pop_request(self) -> Request:
        return self.popleft()

    def peek_request(self) -> Request:
        if not self:
            raise IndexError("peek from an empty queue")
        return self[0]

    def prepend_request(self, request: Request) -> None:
        self.appendleft(request)

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        # extendleft reverses: the last of `requests` ends up at the very front (as vLLM's).
        self.extendleft(requests)

    def remove_request(self, request: Request) -> None:
        self.remove(request)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        gone = {id(r) for r in requests}  # requests compare by identity
        kept = [r for r in self if id(r) not in gone]
        self.clear()
        self.extend(kept)


def priority_key(request: Request) -> tuple:
    """The order a priority queue serves requests in: lower `priority` first, then earlier
    arrival, then request id (vllm/v1/request.py, Request.__lt__)."""
    return request.priority, request.metrics.arrival_time, request.request_id


class PriorityRequestQueue(RequestQueue):
    """Lowest (priority, arrival time, request id) first, kept in a heap. Iterating yields the
    requests in that order (a sorted copy; the heap is untouched)."""

    def __init__(self) -> None:
        # Entries carry a push counter before the request: two requests with equal keys (the
        # same id in two queues' tests) must never fall through to comparing Request objects.
        self._heap: list[tuple[tuple, int, Request]] = []
        self._counter = itertools.count()

    def add_request(self, request: Request) -> None:
        heapq.heappush(self._heap, (priority_key(request), next(self._counter), request))

    def pop_request(self) -> Request:
        if not self._heap:
            raise IndexError("pop from an empty queue")
        return heapq.heappop(self._heap)[-1]

    def peek_request(self) -> Request:
        if not self._heap:
            raise IndexError("peek from an empty queue")
        return self._heap[0][-1]

    def prepend_request(self, request: Request) -> None:
        # No front in a priority order: the request takes its place by its key, which it kept
        # (its priority and first arrival), so a preempted request is not sent to the back.
        self.add_request(request)

    def remove_request(self, request: Request) -> None:
        if request not in self:  # as list.remove and deque.remove say it
            raise ValueError(f"{request.request_id!r} is not in the queue")
        self.remove_requests([request])

    def remove_requests(self, requests: Iterable[Request]) -> None:
        gone = {id(r) for r in requests}
        self._heap = [e for e in self._heap if id(e[-1]) not in gone]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return iter([e[-1] for e in sorted(self._heap, key=lambda e: e[:2])])

    def __contains__(self, request) -> bool:
        return any(e[-1] is request for e in self._heap)

    def __repr__(self) -> str:
        return f"PriorityRequestQueue({[r.request_id for r in self]})"


def create_request_queue(policy: SchedulingPolicy | str) -> RequestQueue:
    """The waiting queue for a policy (vLLM: create_request_queue)."""
    policy = SchedulingPolicy(policy)
    if policy is SchedulingPolicy.PRIORITY:
        return PriorityRequestQueue()
    return FCFSRequestQueue()

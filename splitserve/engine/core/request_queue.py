"""The scheduler's waiting queue, one class per scheduling policy (vLLM's RequestQueue): `fcfs` keeps
arrival order, `priority` keeps (priority, arrival) order. Both are deques (the scheduler peeks at
the front, pops it, removes aborted requests and walks the queue); what differs is where a request
goes in."""

from __future__ import annotations

from collections import deque

from splitserve.engine.core.request import Request


class FCFSQueue(deque):
    """First come, first served: new requests at the back, a preempted one back at the front."""

    def add(self, request: Request) -> None:
        self.append(request)

    def add_front(self, request: Request) -> None:
        """A preempted request: it ran before, so it goes first again."""
        self.appendleft(request)


class PriorityQueue(FCFSQueue):
    """By (priority, arrival time): a request goes after every request that goes first by that key,
    preempted or not (a preempted request keeps its place by its own key)."""

    def add(self, request: Request) -> None:
        key = (request.priority, request.arrival_time)
        index = next((i for i, r in enumerate(self) if (r.priority, r.arrival_time) > key), len(self))
        self.insert(index, request)

    def add_front(self, request: Request) -> None:
        self.add(request)


def make_queue(policy: str) -> FCFSQueue:
    return PriorityQueue() if policy == "priority" else FCFSQueue()

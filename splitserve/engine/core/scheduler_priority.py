"""The scheduler's side of the "priority" policy (vLLM's): requests are ordered by (priority, arrival)
instead of arrival alone. The waiting queue keeps that order (request_queue.PriorityQueue); the
running list is sorted by it at each step, so that the lowest-priority (then latest) running
request is the one preempted. A waiting request also takes the seat of a running one of a strictly
lower priority when every seat (max_num_seqs) is taken: one such preemption per step, so that
urgent requests start within a step or two however busy the engine is. A waiting request of a
better priority than a running one's unfinished prompt takes the step's budget before that
prompt's next chunk, and long_prefill_token_threshold chunks only the prompts of a worse priority
than the best the engine has seen: the steps an urgent request may arrive during stay short, its
own prompt runs whole. A mixin of the Scheduler (engine/core/scheduler.py)."""

from __future__ import annotations

from splitserve.engine.core.request import Request
from splitserve.engine.core.schedule_plan import SchedulePlan


class PrioritySchedulingMixin:
    _best_priority: int | None = None  # the best (lowest) priority added so far

    def _note_priority(self, request: Request) -> None:
        if self._best_priority is None or request.priority < self._best_priority:
            self._best_priority = request.priority

    def _order_by_priority(self, out: SchedulePlan) -> None:
        """The running list in (priority, arrival) order (stable: ties keep their order), and a seat
        freed for a better waiting request when every seat is taken."""
        if self.config.policy != "priority":
            return
        self.running.sort(key=lambda r: (r.priority, r.arrival_time))
        self._free_a_seat_for_priority(out)

    def _chunks_long_prompt(self, request: Request) -> bool:
        """Whether long_prefill_token_threshold applies to this request's prompt."""
        return self.config.policy != "priority" or request.priority > self._best_priority

    def _waits_for_urgent(self, request: Request, urgent: int | None) -> bool:
        """A running request's unfinished prompt that leaves this step's budget to a more urgent
        waiting request (see _urgent_priority)."""
        if urgent is None or request.priority <= urgent:
            return False
        return request.num_computed_tokens < request.num_prompt_tokens

    def _urgent_priority(self) -> int | None:
        """Under the priority policy, the priority of the first waiting request when it has a seat
        to take this step: running prompts of a worse priority leave it the budget first."""
        if self.config.policy != "priority" or not self.waiting or self.swapped:
            return None
        if len(self.running) + len(self.receiving) >= self.config.max_num_seqs:
            return None
        return self.waiting[0].priority

    def _free_a_seat_for_priority(self, out: SchedulePlan) -> None:
        """Every seat taken and the first waiting request of a strictly better priority than the
        worst running one: that one is preempted (recomputed, or swapped out) and waits again."""
        seats = self.config.max_num_seqs - len(self.running) - len(self.receiving)
        if seats > 0 or not self.waiting or not self.running or self.swapped:
            return
        if self.waiting[0].priority < self.running[-1].priority:
            victim = self.running.pop()
            self._preempt(victim, out)
            out.preempted.append(victim)

"""The scheduler's side of preemption by swapping (preemption_mode "swap", vLLM V0's): a preempted
request with room in host memory has its blocks copied there (SchedulePlan's swap_out) and waits in
the swapped queue, oldest first; it comes back into fresh blocks (swap_in) ahead of any waiting
request, and while any request is swapped out no new one is admitted (more would thrash). A mixin
of the Scheduler (engine/core/scheduler.py), whose queues and KV cache manager it works on."""

from __future__ import annotations

from splitserve.engine.core.request import Request, RequestStatus
from splitserve.engine.core.schedule_plan import SchedulePlan


class SwapSchedulingMixin:
    def _swap_out(self, request: Request, out: SchedulePlan) -> bool:
        """Preempt `request` to host memory if the mode and the room allow; whether it was."""
        if self.config.preemption_mode != "swap" or not request.num_computed_tokens:
            return False
        if not self.kv.can_swap_out(request):
            return False
        out.swap_out += self.kv.swap_out(request)
        request.status = RequestStatus.SWAPPED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.swapped.append(request)
        return True

    def _schedule_swapped(self, out: SchedulePlan, budget: int) -> int:
        """Bring swapped-out requests back, oldest first, while budget, seats and blocks last."""
        loras = self._running_loras()
        while self.swapped and budget > 0 and len(self.running) + len(self.receiving) < self.config.max_num_seqs:
            request = self.swapped[0]
            if request.lora_int_id and request.lora_int_id not in loras and len(loras) >= (self.max_loras or 0):
                break
            n = self._chunk(request.num_tokens_with_pending - request.num_computed_tokens, budget, request)
            copies = self.kv.swap_in(request, n + self.config.num_lookahead_tokens)
            if copies is None:
                break
            self.swapped.popleft()
            out.swap_in += copies
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append((request, n))
            budget -= n
            if request.lora_int_id:
                loras.add(request.lora_int_id)
        return budget

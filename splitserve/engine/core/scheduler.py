"""The scheduler: which requests run in the next step, and how many tokens each. Pure Python.

There is no separate prefill or decode phase (as in vLLM V1): every request has computed some
of its tokens (`num_computed_tokens`) and the scheduler hands out a per-step token budget so
that each catches up with its total. Running requests go first (decodes and unfinished prompt
chunks), then waiting ones are admitted while budget, seats and blocks last. When blocks run
out, the most recently admitted running request is preempted: its blocks are freed and it is
recomputed later (its full blocks usually come back as prefix-cache hits); or, with
preemption_mode "swap" and room in host memory, its blocks are copied there (SchedulePlan's
swap_out) and back into fresh blocks when it resumes (swap_in), ahead of any waiting request.

The policies and preemption modes live apart, as mixins over the same queues:
engine/core/scheduler_priority.py (the "priority" policy, with request_queue.PriorityQueue as the
waiting queue), engine/core/scheduler_swap.py (preemption_mode "swap") and engine/core/scheduler_pd.py
(prefill/decode disaggregation).
"""

from __future__ import annotations

import time
from collections import deque

from splitserve.config import SchedulerConfig
from splitserve.engine.core.kv_cache_manager import KVCacheManager
from splitserve.engine.core.request import Request, RequestStatus
from splitserve.engine.core.request_queue import make_queue
from splitserve.engine.core.schedule_plan import PrefixCacheStats, SchedulePlan
from splitserve.engine.core.scheduler_pd import PDSchedulingMixin
from splitserve.engine.core.scheduler_priority import PrioritySchedulingMixin
from splitserve.engine.core.scheduler_swap import SwapSchedulingMixin


class Scheduler(PDSchedulingMixin, PrioritySchedulingMixin, SwapSchedulingMixin):
    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager, max_loras: int | None = None):
        """`max_loras`: most LoRA adapters among the running requests (None: LoRA is off)."""
        self.config = config
        self.kv = kv_manager
        self.max_loras = max_loras
        self.waiting = make_queue(config.policy)  # request_queue.py: FCFS or priority order
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()  # preempted to host memory, oldest first
        self.requests: dict[str, Request] = {}
        self.receiving: dict[str, Request] = {}  # PD decode side: KV being pulled
        self.leased: dict[str, Request] = {}  # PD prefill side: finished, KV kept for a decode instance
        self.clock = time.monotonic  # replaceable in tests
        self._tail_left = 0  # what this step may still take past the budget to finish prompts (_chunk)
        self._prev_schedule_time = 0.0
        self._prev_had_prompts = False
        self._last_prompt_latency = 0.0  # seconds between a step that admitted prompts and the next
        self.num_preemptions = 0
        self.num_generated_tokens = 0  # every request's sampled tokens since start
        self.prefix_cache_stats = PrefixCacheStats()

    # --- queue management -------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        assert request.request_id not in self.requests, f"duplicate request id {request.request_id}"
        self.requests[request.request_id] = request
        self._note_priority(request)
        self.waiting.add(request)

    def finish_requests(self, request_ids, status: RequestStatus) -> list[Request]:
        """Abort (or otherwise finish) requests by id; unknown or finished ids are ignored."""
        assert status.is_finished
        done = []
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None:
                continue
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KV:
                request.status = status  # freed once its pull ends: the connector writes into its blocks
                done.append(request)
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif request.status == RequestStatus.SWAPPED:
                self.swapped.remove(request)
            elif request.status.is_finished:
                continue  # leased: only a pull, a release or the lease's expiry frees it
            else:
                self.waiting.remove(request)
            request.status = status
            self._free(request)
            done.append(request)
        return done

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.receiving or self.swapped)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # --- scheduling -------------------------------------------------------------------------
    def schedule(self) -> SchedulePlan:
        out = SchedulePlan()
        if self.config.waiting_ttl > 0 and self.waiting:
            self._expire_waiting(out)
        self._tail_left = self.config.prompt_tail_tokens if self.config.enable_chunked_prefill else 0
        self._order_by_priority(out)  # the back of the running list is preempted first
        seated = len(out.preempted)  # preempted for a better request's seat, not for lack of blocks
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if len(out.preempted) == seated and self.swapped:
            budget = self._schedule_swapped(out, budget)
        if len(out.preempted) == seated and not self.swapped and self._passed_delay():  # more would thrash
            num_running = len(out.scheduled)
            self._schedule_waiting(out, budget)
            self._prev_had_prompts = len(out.scheduled) > num_running
        out.kv_offload = self.kv.take_offload_ops()
        return out

    def _expire_waiting(self, out: SchedulePlan) -> None:
        """Requests that never ran and waited past waiting_ttl leave the queue (FastDeploy's TTL)."""
        deadline = self.clock() - self.config.waiting_ttl
        for request in [r for r in self.waiting if r.arrival_time < deadline and r.first_scheduled_time is None]:
            self.waiting.remove(request)
            request.status = RequestStatus.FINISHED_ABORTED
            self._free(request)
            out.expired.append(request)

    def _passed_delay(self) -> bool:
        """With a delay factor, waiting prompts are admitted only once the oldest has waited
        delay_factor x the last prompt step's latency, or when nothing else runs."""
        now = self.clock()
        if self._prev_had_prompts:
            self._last_prompt_latency = now - self._prev_schedule_time
        self._prev_schedule_time, self._prev_had_prompts = now, False
        if self.config.delay_factor <= 0 or not self.waiting or not self.running:
            return True
        oldest = min(r.arrival_time for r in self.waiting)
        return now - oldest > self.config.delay_factor * self._last_prompt_latency

    def _chunk(self, remaining: int, budget: int, request: Request) -> int:
        """Tokens of a request's `remaining` ones to compute in this step. A prompt that the budget
        would cut short by no more than what is left of the step's tail allowance
        (prompt_tail_tokens) is finished now: its first token then comes a whole step sooner."""
        n = min(remaining, budget)
        if 0 < remaining - n <= self._tail_left:
            n, self._tail_left = remaining, self._tail_left - (remaining - n)
        threshold = self.config.long_prefill_token_threshold
        if threshold and self.config.enable_chunked_prefill and self._chunks_long_prompt(request):
            n = min(n, threshold)
        return n

    def _schedule_running(self, out: SchedulePlan, budget: int) -> int:
        """Every running request's tokens for this step, in order, while the budget lasts (a loop
        over every row of every step: its common case, a decode, takes the fewest calls)."""
        urgent = self._urgent_priority()
        lookahead, allocate = self.config.num_lookahead_tokens, self.kv.allocate_slots
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if (request.num_pending_tokens and request.reaches_length_limit_with_pending) or (
                urgent is not None and self._waits_for_urgent(request, urgent)
            ):  # it finishes when its pending token is read; or its prompt waits for a more urgent one's
                i += 1
                continue
            remaining = request.num_tokens_with_pending - request.num_computed_tokens
            n = 1 if remaining == 1 else self._chunk(remaining, budget, request)  # a decode: one token, always
            drafts = self._drafts(request, n, budget) if request.spec_token_ids else []
            need = n + len(drafts) + lookahead
            if not allocate(request, need) and not self._allocate_or_preempt(request, need, out):
                break
            if drafts:
                out.spec_tokens[request.request_id] = drafts
            out.scheduled.append((request, n + len(drafts)))
            budget -= n + len(drafts)
            i += 1
        return budget

    @staticmethod
    def _drafts(request: Request, n: int, budget: int) -> list[int]:
        """The draft tokens a decode verifies in this step (as many as the budget leaves room for);
        they are taken either way: the next step gets fresh ones."""
        drafts, request.spec_token_ids = request.spec_token_ids, []
        if not drafts or n != 1 or request.num_pending_tokens:
            return []
        return drafts[: budget - 1]

    def _allocate_or_preempt(self, request: Request, n: int, out: SchedulePlan) -> bool:
        """Find blocks for `request`, preempting from the back of the running list; False when the
        request itself had to be preempted."""
        while not self.kv.allocate_slots(request, n):
            victim = self.running.pop()
            self._preempt(victim, out)
            out.preempted.append(victim)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request, out: SchedulePlan) -> None:
        if self._swap_out(request, out):
            return
        self._free(request)
        request.spec_token_ids = []
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add_front(request)

    def _schedule_waiting(self, out: SchedulePlan, budget: int) -> None:
        """Admit waiting requests in order while budget, seats and blocks last. A request whose LoRA
        adapter would be one too many for this step (max_loras) waits, keeping its place, while the
        ones behind it may go."""
        skipped: list[Request] = []
        loras = self._running_loras()
        while self.waiting and budget > 0 and len(self.running) + len(self.receiving) < self.config.max_num_seqs:
            request = self.waiting[0]
            if request.lora_int_id and request.lora_int_id not in loras and len(loras) >= (self.max_loras or 0):
                skipped.append(self.waiting.popleft())
                continue
            hits, num_cached = self.kv.get_computed_blocks(request)
            if request.wants_remote_prefill and num_cached < request.remote_kv_target:
                if not self._admit_remote_prefill(request, hits, num_cached, out):
                    break
            else:
                remaining = request.num_tokens - num_cached
                if not self.config.enable_chunked_prefill and remaining > budget:
                    break
                n = self._chunk(remaining, budget, request)
                if not self.kv.allocate_slots(
                    request, n + self.config.num_lookahead_tokens, hits, self._decode_reserve()
                ):
                    break
                self._admit(request, num_cached, RequestStatus.RUNNING)
                self.running.append(request)
                out.scheduled.append((request, n))
                budget -= n
            if request.lora_int_id:
                loras.add(request.lora_int_id)
        self.waiting.extendleft(reversed(skipped))

    def _running_loras(self) -> set[int]:
        return {r.lora_int_id for r in self.running if r.lora_int_id} | {
            r.lora_int_id for r in self.receiving.values() if r.lora_int_id
        }

    def _admit(self, request: Request, num_cached: int, status: RequestStatus) -> None:
        self.waiting.popleft()
        request.status = status
        request.num_computed_tokens = num_cached
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_cached
        if self.kv.enable_caching and request.uses_prefix_cache:
            self.prefix_cache_stats.queries += request.num_tokens
            self.prefix_cache_stats.hits += num_cached

    def _decode_reserve(self) -> int:
        """Blocks that new prompts may not take while requests run (FastDeploy's kv_cache_ratio):
        room for the running requests' outputs to grow into, so they are preempted less."""
        if not self.running:
            return 0
        return int((1.0 - self.config.kv_cache_ratio) * self.kv.pool.num_blocks)

    # --- after the model ran ----------------------------------------------------------------
    def advance(self, out: SchedulePlan) -> None:
        """The step is launched: every scheduled request has computed its tokens, and those that
        completed all their tokens get a pending one (being sampled), which the next schedule()
        already counts (overlap scheduling)."""
        for request, n in out.scheduled:
            if request.is_finished():  # stopped by the step before, after this one was launched
                continue
            request.num_computed_tokens += n  # its draft tokens too, until they are verified
            if request.num_computed_tokens >= len(request.all_token_ids) + request.num_pending_tokens:
                request.num_pending_tokens += 1

    def record_samples(self, out: SchedulePlan, sampled: dict[str, list[int]]) -> list[Request]:
        """Append the new tokens of each request that sampled (one, or with speculative decoding its
        accepted drafts and the token after them), checking stop conditions after each: a stop cuts
        the rest. Rejected drafts leave the computed tokens. Returns the requests that got tokens
        (finished ones too), each with `new_token_ids` set. A request finished since the step was
        launched (aborted, or stopped by the step before) drops its tokens."""
        updated = []
        spec_tokens, max_model_len = out.spec_tokens, self.config.max_model_len
        for request, _ in out.scheduled:
            tokens = sampled.get(request.request_id)
            if tokens is None or request.is_finished():
                continue
            assert request.num_pending_tokens > 0
            request.num_pending_tokens -= 1
            if spec_tokens:
                request.num_computed_tokens -= len(spec_tokens.get(request.request_id, ())) - (len(tokens) - 1)
            request.new_token_ids = []
            for token in tokens:
                request.append_output_token(token)
                request.new_token_ids.append(token)
                if request.check_stop(max_model_len):
                    self._finish_stopped(request)
                    break
            self.num_generated_tokens += len(request.new_token_ids)
            updated.append(request)
        return updated

    def _finish_stopped(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        elif request in self.swapped:  # swapped out while its last token was being sampled
            self.swapped.remove(request)
        else:  # preempted while its last token was being sampled
            self.waiting.remove(request)
        if request.keeps_kv_for_remote_decode:
            self.leased[request.request_id] = request
        else:
            self._free(request)

    def _free(self, request: Request) -> None:
        self.kv.free(request)
        if request.is_finished():
            del self.requests[request.request_id]

    def check_invariants(self) -> None:
        self.kv.check_invariants()
        assert len(self.running) <= self.config.max_num_seqs
        assert all(r.status == RequestStatus.RUNNING for r in self.running)
        assert all(r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) for r in self.waiting)
        assert set(self.requests) == (
            {r.request_id for r in self.running}
            | {r.request_id for r in self.waiting}
            | {r.request_id for r in self.swapped}
            | set(self.receiving)
            | set(self.leased)
        )
        assert all(
            r.status == RequestStatus.SWAPPED and r.request_id in self.kv.req_to_cpu_blocks for r in self.swapped
        )
        for r in self.waiting:
            assert r.request_id not in self.kv.req_to_blocks

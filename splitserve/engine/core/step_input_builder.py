"""Turning the scheduler's plan (live Request objects) into the data-only StepInput the model runners
get, sending each runner only what it does not know yet."""

from __future__ import annotations

from collections.abc import Iterable

from splitserve.engine.core.kv_cache_manager import KVCacheManager
from splitserve.engine.core.request import Request
from splitserve.engine.core.schedule_plan import SchedulePlan
from splitserve.executor.step_input import NewRequestData, ScheduledRequest, StepInput


class StepInputBuilder:
    """Remembers which requests the runners hold state for, and how many of each one's block ids
    they have: a request is described in full once, then by its new blocks and tokens each step."""

    def __init__(self, kv_manager: KVCacheManager):
        self.kv = kv_manager
        self.num_blocks_sent: dict[str, int] = {}  # request id -> block ids the runners have
        self.resumed: set[str] = set()  # preempted since last scheduled: blocks start over
        self.forgotten: list[str] = []  # finished since the last step: runners drop them

    def build(self, sched: SchedulePlan) -> StepInput:
        for request in sched.preempted:
            if request.request_id in self.num_blocks_sent:
                self.num_blocks_sent[request.request_id] = 0
                self.resumed.add(request.request_id)
        step = StepInput(
            finished_request_ids=self.forgotten,
            swap_out=sched.swap_out,
            swap_in=sched.swap_in,
            kv_offload=sched.kv_offload,
        )
        self.forgotten = []
        spec_tokens = sched.spec_tokens
        for request, num_tokens in sched.scheduled:
            if request.request_id not in self.num_blocks_sent:
                step.new_requests.append(_new_request_data(request))
            drafts = spec_tokens.get(request.request_id) if spec_tokens else None
            step.scheduled.append(self._scheduled(request, num_tokens, drafts or []))
        return step

    def _scheduled(self, request: Request, num_tokens: int, drafts: list[int]) -> ScheduledRequest:
        """One request's row (called for every row of every step: kept short)."""
        rid = request.request_id
        blocks = self.kv.get_block_ids(rid)
        sent = self.num_blocks_sent.get(rid, 0)
        assert len(blocks) >= sent, f"request {rid} lost blocks without a preemption"
        self.num_blocks_sent[rid] = len(blocks)
        start = request.num_computed_tokens
        end = start + num_tokens - len(drafts)
        token_ids = request.all_token_ids[start:end]
        if drafts:
            token_ids += drafts
        return ScheduledRequest(
            rid,
            start,
            num_tokens,
            token_ids,
            blocks[sent:],
            end == request.num_tokens_with_pending,
            bool(self.resumed) and _take(self.resumed, rid),
            len(drafts),
        )

    def forget(self, request_ids: Iterable[str]) -> None:
        """These requests are done (finished, aborted): the runners drop them before the next step."""
        for rid in request_ids:
            if self.num_blocks_sent.pop(rid, None) is not None:
                self.forgotten.append(rid)
            self.resumed.discard(rid)


def _new_request_data(request: Request) -> NewRequestData:
    return NewRequestData(
        request.request_id,
        request.prompt_token_ids,
        request.sampling_params,
        sorted(request.stop_token_set),
        request.lora_request,
        request.pooling_params,
        request.mm_features,
    )


def _take(items: set[str], item: str) -> bool:
    """Remove `item` from `items`; whether it was there."""
    if item in items:
        items.remove(item)
        return True
    return False

"""The scheduler's side of prefill/decode disaggregation (engine/core/pd.py has the engine's): a decode
instance admits a request whose prompt KV comes from a prefill instance by reserving blocks and
asking for the pull, and runs it on when the pull ends; a prefill instance keeps a finished
request's blocks under a lease until the decode instance has them. A mixin of the Scheduler
(engine/core/scheduler.py), whose queues and KV cache manager it works on."""

from __future__ import annotations

from splitserve.engine.core.request import Request, RequestStatus
from splitserve.engine.core.schedule_plan import SchedulePlan


class PDSchedulingMixin:
    def _admit_remote_prefill(self, request: Request, hits, num_cached: int, out: SchedulePlan) -> bool:
        """Reserve blocks for the prompt tokens whose KV comes from the prefill instance and ask for it
        to be pulled (only the blocks the local prefix cache lacks; see Request.remote_kv_target)."""
        target = request.remote_kv_target
        if not self.kv.allocate_slots(request, target - num_cached, hits, self._decode_reserve(), register=False):
            return False
        self._admit(request, num_cached, RequestStatus.WAITING_FOR_REMOTE_KV)
        self.receiving[request.request_id] = request
        bs = self.kv.block_size
        first = num_cached // bs
        out.kv_pulls.append((request, first, self.kv.get_block_ids(request.request_id)[first : -(-target // bs)]))
        return True

    def finish_remote_prefill(self, request_id: str, ok: bool) -> Request | None:
        """A pull ended. On success the request runs on from the prefill's first token (returned:
        it is the request's first output, and may already finish it), or from its last prompt token
        when it came without one; on failure it computes its prompt itself, as a plain request."""
        request = self.receiving.pop(request_id)
        if request.is_finished():  # aborted while its KV was on the way
            self._free(request)
            return None
        if ok:
            request.num_computed_tokens = request.remote_kv_target
            self.kv.cache_blocks(request, request.num_computed_tokens)
            request.status = RequestStatus.RUNNING
            first = request.kv_transfer.first_token_id
            if first is None:
                self.running.append(request)
                return None
            request.append_output_token(first)
            if request.check_stop(self.config.max_model_len):
                self._free(request)
            else:
                self.running.append(request)
            return request
        self.kv.free(request)
        request.kv_transfer = None
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        self.waiting.add_front(request)
        return None

    def release_lease(self, request_id: str) -> None:
        """PD prefill side: the decode instance has its KV (or the lease expired): free the blocks."""
        request = self.leased.pop(request_id, None)
        if request is not None:
            self._free(request)

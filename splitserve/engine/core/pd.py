"""The engine's side of prefill/decode disaggregation: a prefill instance's lease of a finished
request's blocks (with the first token it sampled), and a decode instance's first output when the
KV arrives with that token; the engine's connector and its poll. The transfer itself is
distributed/kv_transfer/."""

from __future__ import annotations

import logging

from splitserve.engine.core.kv_cache_manager import KVCacheManager
from splitserve.engine.core.request import Request, RequestStatus
from splitserve.engine.core.scheduler import Scheduler
from splitserve.engine.messages import EngineCoreOutput, KVTransferParams

logger = logging.getLogger(__name__)


def first_token_output(request: Request, scheduler: Scheduler) -> EngineCoreOutput:
    """A decode request whose KV arrived with the prefill instance's first token: that token is
    its first output, as if sampled here (its grammar takes it too)."""
    kv = request.kv_transfer
    if request.grammar is not None and not request.grammar.accept_token(kv.first_token_id):
        logger.error("Request %s: the prefill's first token is outside its grammar", request.request_id)
        scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_STOPPED)
    return EngineCoreOutput(
        request.request_id,
        [kv.first_token_id],
        new_logprobs=None if kv.first_logprobs is None else [kv.first_logprobs],
        new_token_logprobs=None if kv.first_token_logprob is None else [kv.first_token_logprob],
        finish_reason=request.status.finish_reason,
        stop_reason=request.stop_reason,
        num_cached_tokens=max(request.num_cached_tokens, 0),
    )


def lease(connector, request: Request, kv_manager: KVCacheManager, output: EngineCoreOutput) -> KVTransferParams:
    """Keep the request's blocks for the decode instance; the answer says where they wait and
    carries the first token sampled from the prompt's logits (see KVTransferParams)."""
    num_pulls = request.kv_transfer.remote_num_pulls
    connector.add_lease(request.request_id, kv_manager.get_block_ids(request.request_id), num_pulls)
    host, port = connector.endpoints[0]
    return KVTransferParams(
        remote_host=host,
        remote_port=port,
        remote_request_id=request.request_id,
        remote_num_pulls=num_pulls,
        remote_endpoints=connector.endpoints if connector.num_ranks > 1 else None,
        first_token_id=request.output_token_ids[0] if request.output_token_ids else None,
        first_token_logprob=output.new_token_logprobs[0] if output.new_token_logprobs else None,
        first_logprobs=output.new_logprobs[0] if output.new_logprobs else None,
    )


def make_connector(config, executor):
    """PD instances move KV blocks between engines. Each rank's connector holds its own share of the
    KV tensors; the engine only calls the group's narrow interface (leases, pulls). None elsewhere."""
    if not config.kv_transfer_config.is_disaggregated:
        return None
    from splitserve.distributed.kv_transfer.connector import KVConnectorGroup

    return KVConnectorGroup(executor.call_kv_connector)


def poll(connector, scheduler: Scheduler, step_inputs) -> list[EngineCoreOutput]:
    """Leases that ended free their blocks, and the requests whose KV arrived run on. Returns their
    first outputs (the prefill's token); `step_inputs` (StepInputBuilder) forgets those it finished."""
    released, pulled = connector.poll()
    for request_id in released:
        scheduler.release_lease(request_id)
    outputs = []
    for result in pulled:
        request = scheduler.finish_remote_prefill(result.request_id, result.ok)
        if request is not None:
            outputs.append(first_token_output(request, scheduler))
            if request.is_finished():
                step_inputs.forget([request.request_id])
    return outputs

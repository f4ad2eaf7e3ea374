"""What every front-end does around an EngineCore, wherever the core runs: hold the Processor that
tokenizes and validates requests, fan a request with n > 1 out into n core requests, and turn core
outputs into text."""

from __future__ import annotations

import time

import msgspec

from splitserve.config import ModelConfig
from splitserve.engine import startup
from splitserve.engine.messages import EngineCoreRequest, KVTransferParams
from splitserve.engine.output_processor import OutputProcessor, RequestOutputKind, RequestState, SampleState
from splitserve.engine.processor import ProcessedRequest, Processor
from splitserve.lora.request import LoRARequest
from splitserve.outputs import RequestMetrics
from splitserve.sampling_params import SamplingParams
from splitserve.tokenizer import get_tokenizer


class FrontEnd:
    def __init__(self, model_config: ModelConfig, tokenizer=None):
        self.model_config = model_config
        if tokenizer is None:
            with startup.phase("tokenizer"):
                tokenizer = get_tokenizer(model_config.tokenizer, model_config.trust_remote_code)
        self.tokenizer = tokenizer
        self.processor = Processor(model_config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.scheduling_policy = "fcfs"  # the engine's (SchedulerConfig.policy): whoever makes this sets it

    def get_tokenizer(self):
        return self.tokenizer

    def prepare_request(
        self,
        request_id: str,
        request: ProcessedRequest,
        kind: RequestOutputKind,
        arrival_time: float | None = None,
        kv_transfer: KVTransferParams | None = None,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
    ) -> list[EngineCoreRequest]:
        """Register a request the Processor has processed; returns the core requests to send (one per sample)."""
        if priority and self.scheduling_policy != "priority":
            raise ValueError(
                f"priority {priority} needs the priority scheduling policy (--scheduling-policy priority); "
                "this engine schedules first come, first served."
            )
        params = request.params
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        samples, core_requests = {}, []
        num_samples = max(params.n, params.best_of or 1)  # best_of > n: draw best_of, keep the best n
        if num_samples > 1 and kv_transfer is not None and kv_transfer.first_token_id is not None:
            # One first token cannot start several samples: each computes its own from the prompt.
            kv_transfer = msgspec.structs.replace(
                kv_transfer, first_token_id=None, first_token_logprob=None, first_logprobs=None
            )
        for i in range(num_samples):
            core_id = request_id if num_samples == 1 else f"{i}_{request_id}"
            child = _sample_params(params, i, num_samples)
            child.bad_words_token_ids = params.bad_words_token_ids
            detokenizer = self.output_processor.new_detokenizer(request.prompt_token_ids, child)
            samples[core_id] = SampleState(i, child, detokenizer)
            core_requests.append(
                self.processor.make_request(
                    core_id,
                    request.prompt_token_ids,
                    child,
                    arrival,
                    kv_transfer,
                    lora_request,
                    priority,
                    request.pooling,
                    request.client_request_id,
                    request.mm_features,
                )
            )
        state = RequestState(
            request_id, request.prompt, request.prompt_token_ids, kind, samples, metrics=RequestMetrics(arrival)
        )
        if num_samples > params.n:
            state.best_of = (params.n, params.logprobs is not None)
        self.output_processor.add_request(state)
        return core_requests


def _sample_params(params: SamplingParams, i: int, num_samples: int) -> SamplingParams:
    """The params of sample i. Samples of one seeded request must differ from each other, yet stay
    reproducible; with best_of > n each must report its sampled tokens' logprobs (to be ranked)."""
    if num_samples == 1:
        return params
    changes = {}
    if params.seed is not None:
        changes["seed"] = params.seed + i
    if num_samples > params.n and params.logprobs is None:
        changes["logprobs"] = 0
    return params.clone(**changes) if changes else params

"""What every front-end does around an EngineCore, wherever the core runs: hold the Processor that
tokenizes and validates requests, fan a request with n > 1 out into n core requests, and turn core
outputs into text."""

from __future__ import annotations

import time

from splitserve.config import ModelConfig
from splitserve.engine.messages import EngineCoreRequest, KVTransferParams
from splitserve.engine.output_processor import OutputProcessor, RequestOutputKind, RequestState, SampleState
from splitserve.engine.processor import ProcessedRequest, Processor
from splitserve.outputs import RequestMetrics
from splitserve.tokenizer import get_tokenizer


class FrontEnd:
    def __init__(self, model_config: ModelConfig, tokenizer=None):
        self.model_config = model_config
        self.tokenizer = tokenizer or get_tokenizer(model_config.tokenizer, model_config.trust_remote_code)
        self.processor = Processor(model_config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)

    def get_tokenizer(self):
        return self.tokenizer

    def prepare_request(
        self,
        request_id: str,
        request: ProcessedRequest,
        kind: RequestOutputKind,
        arrival_time: float | None = None,
        kv_transfer: KVTransferParams | None = None,
    ) -> list[EngineCoreRequest]:
        """Register a request the Processor has processed; returns the core requests to send (one per sample)."""
        params = request.params
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        samples, core_requests = {}, []
        for i in range(params.n):
            core_id = request_id if params.n == 1 else f"{i}_{request_id}"
            # Samples of one seeded request must differ from each other, yet stay reproducible.
            child = params if params.n == 1 or params.seed is None else params.clone(seed=params.seed + i)
            child.bad_words_token_ids = params.bad_words_token_ids
            detokenizer = self.output_processor.new_detokenizer(request.prompt_token_ids, child)
            samples[core_id] = SampleState(i, child, detokenizer)
            core_requests.append(
                self.processor.make_request(core_id, request.prompt_token_ids, child, arrival, kv_transfer)
            )
        state = RequestState(
            request_id, request.prompt, request.prompt_token_ids, kind, samples, metrics=RequestMetrics(arrival)
        )
        self.output_processor.add_request(state)
        return core_requests

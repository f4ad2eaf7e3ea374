"""LLMEngine: the in-process front-end over an EngineCore (tokenize -> core -> detokenize)."""
from __future__ import annotations

import logging
import time

from splitserve.config import EngineArgs, EngineConfig
from splitserve.engine.engine_core import EngineCore
from splitserve.engine.output_processor import OutputProcessor, RequestOutputKind, RequestState, SampleState
from splitserve.engine.processor import Processor, PromptType
from splitserve.outputs import RequestMetrics, RequestOutput
from splitserve.sampling_params import SamplingParams
from splitserve.tokenizer import get_tokenizer

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        mc = config.model_config
        self.tokenizer = get_tokenizer(mc.tokenizer, mc.trust_remote_code)
        self.processor = Processor(mc, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.engine_core = EngineCore(config)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        return cls(args.create_engine_config())

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                    kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
                    arrival_time: float | None = None) -> None:
        processed = self.processor.process_prompt(prompt)
        self.processor.validate_prompt(processed.prompt_token_ids)
        params = self.processor.prepare_params(params)
        samples = {}
        requests = []
        for i in range(params.n):
            core_id = request_id if params.n == 1 else f"{i}_{request_id}"
            child = params if params.n == 1 or params.seed is None else params.clone(seed=params.seed + i)
            child.all_stop_token_ids, child.bad_words_token_ids = params.all_stop_token_ids, params.bad_words_token_ids
            samples[core_id] = SampleState(i, child, self.output_processor.new_detokenizer(
                processed.prompt_token_ids, child))
            requests.append(self.processor.make_request(core_id, processed.prompt_token_ids, child))
        metrics = RequestMetrics(arrival_time if arrival_time is not None else time.monotonic())
        self.output_processor.add_request(RequestState(request_id, processed.prompt, processed.prompt_token_ids,
                                                       kind, samples, metrics=metrics))
        for request in requests:
            self.engine_core.add_request(request)

    def abort_request(self, request_ids) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        self.engine_core.abort_requests(self.output_processor.abort(request_ids))

    def step(self) -> list[RequestOutput]:
        core_outputs = self.engine_core.step()
        outputs, stopped = self.output_processor.process_outputs(core_outputs)
        if stopped:
            self.engine_core.abort_requests(stopped)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self.output_processor.requests)

    def get_tokenizer(self):
        return self.tokenizer

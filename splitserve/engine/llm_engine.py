"""LLMEngine: the in-process front-end over an EngineCore (tokenize -> core -> detokenize)."""

from __future__ import annotations

from dataclasses import replace

from splitserve import step_timing
from splitserve.config import EngineConfig
from splitserve.engine import startup
from splitserve.engine.arg_utils import EngineArgs
from splitserve.engine.core.engine_core import EngineCore
from splitserve.engine.frontend import FrontEnd
from splitserve.engine.output_processor import RequestOutputKind
from splitserve.engine.processor import ProcessedRequest, PromptType
from splitserve.lora.request import LoRARequest
from splitserve.outputs import RequestOutput
from splitserve.pooling_params import PoolingParams
from splitserve.sampling_params import SamplingParams


class LLMEngine(FrontEnd):
    def __init__(self, config: EngineConfig):
        super().__init__(config.model_config)
        self.config = config
        self.scheduling_policy = config.scheduler_config.policy
        if config.parallel_config.data_parallel_size > 1:  # replicas in their own processes (engine/dp_client.py)
            from splitserve.engine.dp_client import DataParallelEngineClient

            self.engine_core = DataParallelEngineClient(config)
        else:
            self.engine_core = EngineCore(config, tokenizer=self.tokenizer)
        startup.report("offline engine")

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args.create_engine_config())

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
        pooling_params: PoolingParams | None = None,
    ) -> None:
        """`params` is None for a pooling request (`pooling_params` given, the pooling runner). `prompt`
        may be a ProcessedRequest (a prompt processed once, its images with it, run again with
        `params`: beam search's steps)."""
        if params is None:
            request = self.processor.process_pooling(prompt, pooling_params, param="prompt")
        elif isinstance(prompt, ProcessedRequest):
            request = replace(prompt, params=self.processor.process_params(params))
        else:
            request = self.processor.process(prompt, params)
        if lora_request is not None:
            self.add_lora(lora_request)
        core_requests = self.prepare_request(
            request_id, request, kind, arrival_time, lora_request=lora_request, priority=priority
        )
        try:
            for core_request in core_requests:
                self.engine_core.add_request(core_request)
        except Exception:  # refused by the core (asleep, an adapter gone): forget it here too
            self.abort_request([request_id])
            raise

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Serve an adapter (read and checked now; a no-op when it is already served)."""
        self.engine_core.loras.add(lora_request)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        lora = self.engine_core.loras.by_id.get(lora_int_id)
        if lora is None:
            return False
        self.engine_core.loras.remove(lora.lora_name)
        return True

    def list_loras(self) -> set[int]:
        return set(self.engine_core.loras.by_id)

    def abort_request(self, request_ids) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        self.engine_core.abort_requests(self.output_processor.abort(request_ids))

    def step(self) -> list[RequestOutput]:
        step_timing.lap("other")
        self.engine_core.poll_connector()
        core_outputs = self.engine_core.step_fn()
        outputs, stopped = self.output_processor.process_outputs(core_outputs)
        step_timing.lap("output processing")
        if stopped:
            self.engine_core.abort_requests(stopped)
        for output in outputs:
            if isinstance(output, Exception):
                raise output
        return outputs

    def expert_load(self) -> dict[int, list[int]]:
        """A mixture-of-experts model's tokens per expert since start, by layer (load balance)."""
        return self.engine_core.executor.expert_load()

    def has_unfinished_requests(self) -> bool:
        return bool(self.output_processor.requests)

    def shutdown(self) -> None:
        """Stop the engine's ranks (worker processes or Ray actors) and its KV connector."""
        self.engine_core.shutdown()

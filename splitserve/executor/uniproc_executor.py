"""One rank, in the engine core's own process: the ModelRunner is called directly."""

from __future__ import annotations

from splitserve.config import EngineConfig
from splitserve.distributed import ParallelRank
from splitserve.distributed.kv_transfer.handler import KVTransferHandler
from splitserve.executor.abstract import Executor
from splitserve.executor.cpu_binding import configure_cpu_threads
from splitserve.executor.in_flight import InFlightStep
from splitserve.executor.model_runner import ModelRunner
from splitserve.executor.sleep_mode import RankSleep
from splitserve.executor.step_input import ModelRunnerOutput, StepInput
from splitserve.kernels import batch_invariant


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig):
        super().__init__(config)
        if config.device.type == "cpu":  # an engine in the caller's process (LLM) has no core_proc to do it
            configure_cpu_threads()
        self.runner = ModelRunner(config)
        self.sleeping = RankSleep(lambda: ModelRunner(config), config.model_config)
        self._last: InFlightStep | None = None  # the step a pending input token comes from
        self.kv_transfer = KVTransferHandler(config.kv_transfer_config, ParallelRank())

    def determine_num_blocks(self) -> int:
        return self.runner.determine_num_blocks()

    def determine_num_cpu_blocks(self, nbytes: int | None = None) -> int:
        return self.runner.determine_num_cpu_blocks(nbytes)

    def kv_cache_memory(self) -> tuple[int, int]:
        return self.runner.kv_cache_memory() if self.runner is not None else (0, 0)  # None: asleep, level 2

    def _rank_expert_load(self) -> list[dict[int, list[int]]]:
        return [self.runner.expert_load() if self.runner is not None else {}]

    def initialize_kv_cache(self, num_blocks: int, num_cpu_blocks: int = 0, num_offload_blocks: int = 0) -> None:
        self.runner.initialize_kv_cache(num_blocks, num_cpu_blocks, num_offload_blocks)

    def capture_cuda_graphs(self) -> None:
        self.runner.capture_cuda_graphs()

    def launch(self, step_input: StepInput) -> InFlightStep:
        self._last = self.runner.launch(step_input, self._last)
        return self._last

    def collect(self, handle: InFlightStep) -> ModelRunnerOutput:
        return self.runner.collect(handle)

    def add_lora(self, lora) -> None:
        self.runner.add_lora(lora)

    def remove_lora(self, lora_int_id: int) -> None:
        self.runner.remove_lora(lora_int_id)

    def sleep(self, level: int) -> None:
        self._last = None
        self.runner = self.sleeping.sleep(self.runner, level)

    def wake_up(self, num_blocks: int, num_cpu_blocks: int, weights: tuple[str, str] | None = None) -> None:
        self.runner = self.sleeping.wake_up(self.runner, num_blocks, num_cpu_blocks, weights)

    def shutdown(self) -> None:
        if self.runner is not None and self.runner.offload is not None:
            self.runner.offload.close()  # the disk tier's queued writes, so that a restart finds them
        if self.config.batch_invariant:  # a mode of the whole process: the next engine here starts without it
            batch_invariant.disable()

    def call_kv_connector(self, method: str, *args) -> list:
        return [self.kv_transfer.handle(self.runner, method, list(args))]

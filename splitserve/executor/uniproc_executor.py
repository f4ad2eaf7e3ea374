"""One rank, in the engine core's own process: its RankCalls (and ModelRunner) are called directly."""

from __future__ import annotations

from splitserve.config import EngineConfig
from splitserve.distributed import ParallelRank
from splitserve.executor.abstract import Executor
from splitserve.executor.cpu_binding import configure_cpu_threads
from splitserve.executor.in_flight import InFlightStep
from splitserve.executor.rank_calls import RankCalls
from splitserve.executor.step_input import ModelRunnerOutput, StepInput
from splitserve.kernels import batch_invariant


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig):
        super().__init__(config)
        if config.device.type == "cpu":  # an engine in the caller's process (LLM) has no core_proc to do it
            configure_cpu_threads()
        self.rank = RankCalls(config, ParallelRank())

    @property
    def runner(self):
        """The ModelRunner (None while asleep at level 2)."""
        return self.rank.runner

    def collective_rpc(self, method: str, *args) -> list:
        return [self.rank.call(method, args)]

    def launch(self, step_input: StepInput) -> InFlightStep:
        return self.rank.launch(step_input)

    def collect(self, handle: InFlightStep) -> ModelRunnerOutput:
        assert handle is self.rank.in_flight[0], "steps are collected in the order they were launched"
        return self.rank.collect()

    def shutdown(self) -> None:
        self.rank.flush_kv_offload()  # the disk tier's queued writes, so that a restart finds them
        if self.config.batch_invariant:  # a mode of the whole process: the next engine here starts without it
            batch_invariant.disable()

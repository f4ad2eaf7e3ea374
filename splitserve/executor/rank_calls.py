"""What one rank does for the executor, wherever it runs: in the engine core's process
(UniProcExecutor), in a worker process (MultiprocExecutor) or in a Ray actor (RayDistributedExecutor).

`RankCalls` owns the rank's ModelRunner and answers the executor's per-rank calls. The executor
reaches them through one method, `Executor.collective_rpc(method, *args)` (executor/abstract.py),
which runs `method` on every rank and returns the answers in rank order; only the names in `CALLS`
can be called that way. A new per-rank query is a method here (and, when the runner answers it,
there), its name in CALLS, and a line in Executor that asks it.

Steps do not go through collective_rpc: `launch` queues a step (no answer, so that the engine can
prepare the next one meanwhile) and `collect` returns the oldest launched step's result.
"""

from __future__ import annotations

from collections import deque

import msgspec

from splitserve.config import EngineConfig
from splitserve.distributed import ParallelRank
from splitserve.distributed.kv_transfer.handler import KVTransferHandler
from splitserve.executor.in_flight import InFlightStep
from splitserve.executor.sleep_mode import RankSleep
from splitserve.executor.step_input import ModelRunnerOutput, StepInput
from splitserve.lora.request import LoRARequest

# What collective_rpc may run on a rank: nothing else is reachable through it (nor through a worker's pipe).
CALLS = frozenset(
    {
        "ready",
        "determine_num_blocks",
        "determine_num_cpu_blocks",
        "initialize_kv_cache",
        "capture_cuda_graphs",
        "kv_cache_memory",
        "expert_load",
        "add_lora",
        "remove_lora",
        "sleep",
        "wake_up",
        "flush_kv_offload",
        "kv_connector",
    }
)


class RankCalls:
    def __init__(self, config: EngineConfig, rank: ParallelRank, kv_host: str | None = None):
        """`kv_host`: the address other instances reach this rank's KV connector at, when it is not
        the instance's (a rank on another machine of a Ray cluster)."""
        from splitserve.executor.model_runner import ModelRunner  # builds the model: after the process groups

        self.rank = rank
        self.runner = ModelRunner(config)
        self.sleeping = RankSleep(lambda: ModelRunner(config), config.model_config)
        self.in_flight: deque[InFlightStep] = deque()  # launched steps, oldest first
        self.kv_transfer = KVTransferHandler(config.kv_transfer_config, rank, kv_host)

    def call(self, method: str, args) -> object:
        """One collective_rpc call on this rank."""
        if method not in CALLS:
            raise ValueError(f"unknown rank call {method!r}; known: {', '.join(sorted(CALLS))}")
        return getattr(self, method)(*args)

    # --- steps ------------------------------------------------------------------------------
    def launch(self, step: StepInput) -> InFlightStep:
        """Queue a step; a request whose last input token is still being sampled takes it from the
        step launched before (overlap scheduling)."""
        previous = self.in_flight[-1] if self.in_flight else None
        launched = self.runner.launch(step, previous)
        self.in_flight.append(launched)
        return launched

    def collect(self) -> ModelRunnerOutput:
        return self.runner.collect(self.in_flight.popleft())

    # --- the calls (CALLS) ------------------------------------------------------------------
    def ready(self) -> int:
        return self.rank.rank

    def determine_num_blocks(self) -> int:
        return self.runner.determine_num_blocks()

    def determine_num_cpu_blocks(self, nbytes: int | None = None) -> int:
        return self.runner.determine_num_cpu_blocks(nbytes)

    def initialize_kv_cache(self, num_blocks: int, num_cpu_blocks: int = 0, num_offload_blocks: int = 0) -> None:
        self.runner.initialize_kv_cache(num_blocks, num_cpu_blocks, num_offload_blocks)

    def capture_cuda_graphs(self) -> None:
        self.runner.capture_cuda_graphs()

    def kv_cache_memory(self) -> tuple[int, int]:
        return self.runner.kv_cache_memory() if self.runner is not None else (0, 0)  # None: asleep, level 2

    def expert_load(self) -> dict[int, list[int]]:
        return self.runner.expert_load() if self.runner is not None else {}

    def add_lora(self, lora: LoRARequest | dict) -> None:
        """`lora` arrives as a dict through a worker's pipe."""
        self.runner.add_lora(lora if isinstance(lora, LoRARequest) else msgspec.convert(lora, LoRARequest))

    def remove_lora(self, lora_int_id: int) -> None:
        self.runner.remove_lora(lora_int_id)

    def sleep(self, level: int) -> None:
        self.in_flight.clear()
        self.runner = self.sleeping.sleep(self.runner, level)

    def wake_up(self, num_blocks: int, num_cpu_blocks: int, weights: tuple[str, str] | None = None) -> None:
        self.runner = self.sleeping.wake_up(self.runner, num_blocks, num_cpu_blocks, weights)

    def flush_kv_offload(self) -> None:
        """Wait for the disk tier's queued writes (before shutdown: a restart then finds them)."""
        if self.runner is not None and self.runner.offload is not None:
            self.runner.offload.close()

    def kv_connector(self, method: str, args: list):
        """A KV connector method on this rank (prefill/decode disaggregation)."""
        return self.kv_transfer.handle(self.runner, method, args)

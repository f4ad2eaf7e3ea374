"""The Executor: what runs the model for the EngineCore, on one rank or many (vLLM v1's design).

The engine core hands it each step as data (a StepInput) and gets the sampled tokens back; it
never sees where the ranks run:

- UniProcExecutor: one rank, in the engine core's own process;
- MultiprocExecutor: one worker process per rank on this machine, the step sent to every rank;
- RayDistributedExecutor: one Ray actor per rank, on this machine or across a Ray cluster.

Every rank holds its share of the model (tensor parallelism) or its layers (pipeline stages) and
its own KV cache; the engine reads the sampled tokens of the output rank (the first tensor-parallel
rank of the last stage). `launch` returns at once where the device allows; `collect` waits for
that step's tokens, so that the engine can prepare the next step meanwhile (overlap scheduling).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod

from splitserve.config import EngineConfig
from splitserve.executor.step_input import ModelRunnerOutput, StepInput

logger = logging.getLogger(__name__)


class Executor(ABC):
    """Subclasses run the ranks: they implement collective_rpc, launch and collect (and check_health
    and shutdown where ranks live elsewhere); the per-rank calls below are written once, here."""

    def __init__(self, config: EngineConfig):
        self.config = config

    @abstractmethod
    def collective_rpc(self, method: str, *args) -> list:
        """Run RankCalls.`method`(*args) on every rank (executor/rank_calls.py); the answers in rank order."""

    @abstractmethod
    def launch(self, step_input: StepInput) -> object:
        """Start one step on every rank; returns a handle for collect()."""

    @abstractmethod
    def collect(self, handle: object) -> ModelRunnerOutput:
        """The sampled tokens (and logprobs) of a launched step, once they are known. Steps are
        collected in the order they were launched."""

    def determine_num_blocks(self) -> int:
        """KV-cache blocks every rank can hold (the smallest of the ranks' answers)."""
        return min(self.collective_rpc("determine_num_blocks"))

    def determine_num_cpu_blocks(self, nbytes: int | None = None) -> int:
        """Host blocks every rank can hold in `nbytes` of host memory per rank (None: those for
        swapped-out KV, 0 when not swapping)."""
        return min(self.collective_rpc("determine_num_cpu_blocks", nbytes))

    def initialize_kv_cache(self, num_blocks: int, num_cpu_blocks: int = 0, num_offload_blocks: int = 0) -> None:
        """The device cache's blocks, host blocks for swapped-out KV and for the offloading tier."""
        self.collective_rpc("initialize_kv_cache", num_blocks, num_cpu_blocks, num_offload_blocks)

    def kv_cache_memory(self) -> tuple[int, int]:
        """(bytes allocated, bytes resident) of the KV cache over all ranks: a CPU cache is mapped
        lazily and becomes resident as its blocks are first used."""
        per_rank = self.collective_rpc("kv_cache_memory")
        return sum(a for a, _ in per_rank), sum(r for _, r in per_rank)

    def capture_cuda_graphs(self) -> None:
        self.collective_rpc("capture_cuda_graphs")

    def add_lora(self, lora) -> None:
        """Read a LoRA adapter (a LoRARequest) on every rank, ready for requests that name it."""
        self.collective_rpc("add_lora", lora)

    def remove_lora(self, lora_int_id: int) -> None:
        """Forget an adapter on every rank."""
        self.collective_rpc("remove_lora", lora_int_id)

    def sleep(self, level: int) -> None:
        """Release every rank's KV cache, and its weights to host memory (1) or altogether (2)."""
        self.collective_rpc("sleep", level)

    def wake_up(self, num_blocks: int, num_cpu_blocks: int, weights: tuple[str, str] | None = None) -> None:
        """Weights back on the device (read again after level 2) and a new, empty KV cache;
        `weights` (path, load format): after level 2, read these instead (engine/core/weight_update.py)."""
        self.collective_rpc("wake_up", num_blocks, num_cpu_blocks, weights)

    def expert_load(self) -> dict[int, list[int]]:
        """Tokens routed to each expert since start, by MoE layer (empty for a dense model)."""
        return merge_expert_load(self.collective_rpc("expert_load"))

    def call_kv_connector(self, method: str, *args) -> list:
        """Run a KV connector method on every rank (prefill/decode disaggregation); answers in rank order."""
        return self.collective_rpc("kv_connector", method, list(args))

    def check_health(self) -> None:
        """Raise (naming the rank) if a rank has died; between steps, while the engine is idle."""

    def shutdown(self) -> None:
        pass

    def _wait_for_disk_tier(self) -> None:
        """Before the ranks are stopped: their queued writes to the KV disk tier (--kv-cache-dir), so
        that a restart finds those blocks."""
        if not self.config.cache_config.kv_cache_dir:
            return
        try:
            self.collective_rpc("flush_kv_offload")
        except Exception as exc:  # stopping regardless: at worst the last blocks are not on disk
            logger.warning("The disk tier's last writes were not waited for: %s", exc)


def merge_expert_load(per_rank: list[dict]) -> dict[int, list[int]]:
    """One count per MoE layer from the ranks' answers: the ranks of a pipeline stage report the same
    layers (each routes every token), the stages different ones."""
    merged: dict[int, list[int]] = {}
    for answer in per_rank:
        for layer, counts in answer.items():
            merged.setdefault(int(layer), list(counts))
    return dict(sorted(merged.items()))

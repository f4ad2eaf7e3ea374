"""One rank of a distributed engine: joins the process groups, builds its ModelRunner, and answers
the executor's messages. The same Worker runs in a worker process (MultiprocExecutor) and in a Ray
actor (RayDistributedExecutor).

Messages are typed msgspec structs: `Launch` (a step; no answer, so that the executor can prepare
the next step meanwhile), `Collect` (the oldest launched step's result: the output rank answers with
the sampled tokens, the others with an empty output once their share is done) and `Call` (set-up
and queries, answered by every rank). An exception is answered as an error naming the rank; after
a failed `Launch` the error is the answer to the next message.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from typing import Any

import msgspec
import torch

from splitserve.config import EngineConfig
from splitserve.distributed import ParallelRank, init_distributed
from splitserve.distributed.kv_transfer.handler import KVTransferHandler
from splitserve.executor.sleep_mode import RankSleep
from splitserve.executor.step_input import ModelRunnerOutput, StepInput
from splitserve.lora.request import LoRARequest

logger = logging.getLogger(__name__)


class Launch(msgspec.Struct, tag="launch", array_like=True):
    step: StepInput


class Collect(msgspec.Struct, tag="collect", array_like=True):
    pass


class Call(msgspec.Struct, tag="call", array_like=True):
    method: str
    args: list[Any] = []


WorkerMessage = Launch | Collect | Call


class WorkerReply(msgspec.Struct, array_like=True, omit_defaults=True):
    value: Any = None
    output: ModelRunnerOutput | None = None
    error: str | None = None


ENCODER = msgspec.msgpack.Encoder()
MESSAGE_DECODER = msgspec.msgpack.Decoder(WorkerMessage)
REPLY_DECODER = msgspec.msgpack.Decoder(WorkerReply)
# What a Call may run on a worker: nothing else is reachable through the message channel.
_CALLS = (
    "determine_num_blocks",
    "determine_num_cpu_blocks",
    "initialize_kv_cache",
    "capture_cuda_graphs",
    "kv_cache_memory",
    "expert_load",
    "ready",
    "kv_connector",
    "add_lora",
    "remove_lora",
    "sleep",
    "wake_up",
    "flush_kv_offload",
)


class Worker:
    def __init__(
        self,
        config: EngineConfig,
        rank: ParallelRank,
        init_method: str,
        local_rank: int = 0,
        kv_host: str | None = None,
    ):
        """`kv_host`: the address other instances reach this rank's KV connector at, when it is not
        the instance's (a rank on another machine of a Ray cluster)."""
        rank = dataclasses.replace(rank, expert_parallel=config.parallel_config.enable_expert_parallel)
        self.rank = rank
        if config.device.type == "cuda":
            config.device = torch.device("cuda", local_rank)
            torch.cuda.set_device(config.device)
        init_distributed(rank, init_method, config.device)
        from splitserve.executor.model_runner import ModelRunner

        self.runner = ModelRunner(config)
        self.sleeping = RankSleep(lambda: ModelRunner(config), config.model_config)
        self.in_flight: deque = deque()  # launched steps, oldest first
        self.failure: str | None = None
        self.kv_transfer = KVTransferHandler(config.kv_transfer_config, rank, kv_host)

    # --- the message channel ----------------------------------------------------------------
    def handle(self, payload: bytes) -> bytes | None:
        """One message in, its answer out (None for a Launch)."""
        message = MESSAGE_DECODER.decode(payload)
        if isinstance(message, Launch):
            self._launch(message.step)
            return None
        if self.failure is not None:
            return ENCODER.encode(WorkerReply(error=self.failure))
        try:
            if isinstance(message, Collect):
                return ENCODER.encode(WorkerReply(output=self._collect()))
            if message.method not in _CALLS:
                raise ValueError(f"unknown worker call {message.method!r}")
            return ENCODER.encode(WorkerReply(value=getattr(self, message.method)(*message.args)))
        except Exception as exc:  # the executor raises it in the engine, naming this rank
            return ENCODER.encode(WorkerReply(error=self._describe(exc)))

    def _describe(self, exc: BaseException) -> str:
        logger.exception("Rank %d failed", self.rank.rank)
        return f"rank {self.rank.rank} ({self.rank}) failed: {type(exc).__name__}: {exc}"

    # --- what the messages do ---------------------------------------------------------------
    def _launch(self, step: StepInput) -> None:
        if self.failure is not None:
            return
        try:
            previous = self.in_flight[-1] if self.in_flight else None
            self.in_flight.append(self.runner.launch(step, previous))
        except Exception as exc:
            self.failure = self._describe(exc)

    def _collect(self) -> ModelRunnerOutput | None:
        output = self.runner.collect(self.in_flight.popleft())
        return output if self.rank.is_output_rank else None

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

    def add_lora(self, lora: dict) -> None:
        self.runner.add_lora(msgspec.convert(lora, LoRARequest))

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
        return self.kv_transfer.handle(self.runner, method, args)

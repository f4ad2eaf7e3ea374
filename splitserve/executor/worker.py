"""One rank of a distributed engine: joins the process groups, builds its ModelRunner, and answers
the executor's messages. The same Worker runs in a worker process (MultiprocExecutor) and in a Ray
actor (RayDistributedExecutor).

Messages are typed msgspec structs: `Launch` (a step; no answer, so that the executor can prepare
the next step meanwhile), `Collect` (the oldest launched step's result: the output rank answers with
the sampled tokens, the others with an empty output once their share is done) and `Call` (set-up
and queries, answered by every rank: a RankCalls method, executor/rank_calls.py). An exception is
answered as an error naming the rank; after a failed `Launch` the error is the answer to the next
message.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import msgspec
import torch

from splitserve.config import EngineConfig
from splitserve.distributed import ParallelRank, init_distributed
from splitserve.executor.rank_calls import RankCalls
from splitserve.executor.step_input import ModelRunnerOutput, StepInput

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


class Worker(RankCalls):
    def __init__(
        self,
        config: EngineConfig,
        rank: ParallelRank,
        init_method: str,
        local_rank: int = 0,
        kv_host: str | None = None,
    ):
        """`kv_host`: see RankCalls."""
        rank = dataclasses.replace(rank, expert_parallel=config.parallel_config.enable_expert_parallel)
        if config.device.type == "cuda":
            config.device = torch.device("cuda", local_rank)
            torch.cuda.set_device(config.device)
        init_distributed(rank, init_method, config.device)
        super().__init__(config, rank, kv_host)
        self.failure: str | None = None

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
                output = self.collect()
                return ENCODER.encode(WorkerReply(output=output if self.rank.is_output_rank else None))
            return ENCODER.encode(WorkerReply(value=self.call(message.method, message.args)))
        except Exception as exc:  # the executor raises it in the engine, naming this rank
            return ENCODER.encode(WorkerReply(error=self._describe(exc)))

    def _describe(self, exc: BaseException) -> str:
        logger.exception("Rank %d failed", self.rank.rank)
        return f"rank {self.rank.rank} ({self.rank}) failed: {type(exc).__name__}: {exc}"

    def _launch(self, step: StepInput) -> None:
        if self.failure is not None:
            return
        try:
            self.launch(step)
        except Exception as exc:
            self.failure = self._describe(exc)

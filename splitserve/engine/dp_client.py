"""Data parallelism for the offline engine (`LLM(data_parallel_size=N)`, vLLM's argument): N engine
core processes, each a whole replica of the model with its own ranks (tensor/pipeline parallel)
and KV cache, behind the one in-process front-end, which tokenizes and detokenizes for all of them.

Each request goes to the replica with the fewest requests in flight (the lowest index on a tie),
over the same ZMQ messages the API server's AsyncLLM uses (engine/core/core_proc.py); the front-end's
step collects whatever the replicas have sent. On a CPU each replica gets its own share of the cores
(SPLITSERVE_CPU_CORES), on CUDA its own GPUs (CUDA_VISIBLE_DEVICES), so that replicas never compete
for one. LoRA adapters, sleep mode and weight updates act on every replica. This client stands
where LLMEngine otherwise holds an EngineCore (`engine_core`).
"""

from __future__ import annotations

import logging
import os

import msgspec
import zmq

from splitserve.config import EngineConfig
from splitserve.engine.engine_process import EngineProcess
from splitserve.engine.lora_registry import LoRANotFoundError
from splitserve.engine.messages import (
    AbortRequests,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    LoRACall,
    LoRAReply,
    SleepCall,
    SleepReply,
)
from splitserve.executor.cpu_binding import CPU_CORES_ENV, available_cores, split_cores
from splitserve.lora.request import LoRARequest

logger = logging.getLogger(__name__)

RANK_ENV = "SPLITSERVE_DATA_PARALLEL_RANK"  # envs.py
_POLL_MS = 100  # how long a step waits for the replicas before it looks at their processes


class DataParallelEngineClient:
    def __init__(self, config: EngineConfig):
        size = config.parallel_config.data_parallel_size
        self.config = config
        self.engines: list[EngineProcess] = []
        self.sockets: list[zmq.Socket] = []
        try:
            for env in replica_environments(config, size):
                self.engines.append(EngineProcess(config, env=env))
            for engine in self.engines:
                engine.wait_ready(config)
        except BaseException:
            self.shutdown()
            raise
        context = zmq.Context.instance()
        for index, engine in enumerate(self.engines):
            socket = context.socket(zmq.DEALER)
            socket.setsockopt(zmq.IDENTITY, f"dp-client-{os.getpid()}-{index}".encode())
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(engine.address)
            self.sockets.append(socket)
        self.poller = zmq.Poller()
        for socket in self.sockets:
            self.poller.register(socket, zmq.POLLIN)
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        self.owner: dict[str, int] = {}  # core request id -> replica
        self.in_flight = [0] * size
        self.num_requests = [0] * size  # sent to each replica since start
        self._outputs: list[EngineCoreOutput] = []  # read but not yet handed to a step
        self._next_call = 0
        self.loras = ReplicaLoRAs(self)
        self.sleeping = ReplicaSleep(self)
        logger.info("Data parallelism: %d engine replicas (pids %s)", size, ", ".join(str(e.pid) for e in self.engines))

    # --- what LLMEngine calls on its engine core ------------------------------------------------
    def add_request(self, request: EngineCoreRequest) -> None:
        replica = min(range(len(self.engines)), key=self.in_flight.__getitem__)
        self.owner[request.request_id] = replica
        self.in_flight[replica] += 1
        self.num_requests[replica] += 1
        self.sockets[replica].send(self.encoder.encode(request))

    def abort_requests(self, request_ids: list[str]) -> None:
        by_replica: dict[int, list[str]] = {}
        for rid in request_ids:
            replica = self.owner.pop(rid, None)
            if replica is not None:
                self.in_flight[replica] -= 1
                by_replica.setdefault(replica, []).append(rid)
        for replica, ids in by_replica.items():
            self.sockets[replica].send(self.encoder.encode(AbortRequests(ids)))

    def has_unfinished_requests(self) -> bool:
        return bool(self.owner)

    def poll_connector(self) -> None:
        pass  # no KV connector: PD instances are servers

    def step_fn(self) -> list[EngineCoreOutput]:
        """The outputs the replicas sent since the last call, waiting for at least one message."""
        if not self._outputs:  # else read already, while a call waited for its answers
            self._read(_POLL_MS)
        outputs, self._outputs = self._outputs, []
        return outputs

    def _read(self, timeout_ms: int) -> list[tuple[int, LoRAReply | SleepReply]]:
        """Read what the replicas sent (waiting up to `timeout_ms` for the first message): outputs
        are kept for step_fn, answers to calls (LoRA, sleep) returned with their replica."""
        replies = []
        ready = dict(self.poller.poll(timeout_ms))
        if not ready:
            self._check_alive()
        for replica, socket in enumerate(self.sockets):
            if socket not in ready:
                continue
            while True:
                try:
                    message = self.decoder.decode(socket.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
                if message.engine_dead is not None:
                    raise RuntimeError(f"Data-parallel replica {replica} died: {message.engine_dead}")
                for output in message.outputs:
                    if output.finished and self.owner.pop(output.request_id, None) is not None:
                        self.in_flight[replica] -= 1
                self._outputs.extend(message.outputs)
                replies += [(replica, r) for r in (message.lora_reply, message.sleep_reply) if r is not None]
        return replies

    def call_replicas(self, call: LoRACall | SleepCall) -> list[LoRAReply | SleepReply]:
        """A call on every replica (a LoRA change, sleep mode, a weight update), so that they stay
        alike; their answers, in replica order."""
        call.call_id = self._next_call = self._next_call + 1
        for socket in self.sockets:
            socket.send(self.encoder.encode(call))
        answers: dict[int, LoRAReply | SleepReply] = {}
        while len(answers) < len(self.sockets):
            answers.update((r, reply) for r, reply in self._read(_POLL_MS) if reply.call_id == call.call_id)
        return [answers[r] for r in range(len(self.sockets))]

    def _check_alive(self) -> None:
        for replica, engine in enumerate(self.engines):
            if not engine.is_alive():
                lines = "\n".join(engine.last_log_lines())
                raise RuntimeError(f"Data-parallel replica {replica} exited ({engine.describe_exit()}):\n{lines}")

    def __getattr__(self, name: str):
        # What only an EngineCore in this process has: expert load, its scheduler and executor.
        # Refused by name rather than failing deep inside.
        raise NotImplementedError(
            f"LLM(data_parallel_size > 1) does not support what needs the engine core's {name!r} yet (expert "
            "load): use one replica for it."
        )

    def shutdown(self) -> None:
        for socket in self.sockets:
            socket.close()
        for engine in self.engines:
            engine.shutdown()


class ReplicaLoRAs:
    """The LoRA adapters of every replica, where LLMEngine uses an EngineCore's LoRARegistry: each
    change goes to every replica (under the id the caller chose), and a replica's refusal is the
    caller's error (a ValueError naming what does not fit, as the registry's own)."""

    def __init__(self, client: DataParallelEngineClient):
        self.client = client
        self.by_id: dict[int, LoRARequest] = {}

    def add(self, lora: LoRARequest) -> LoRARequest:
        if self.by_id.get(lora.lora_int_id) == lora:
            return lora
        self._call(LoRACall(0, "add", lora.lora_name, lora.lora_path, lora.base_model_name, lora.lora_int_id))
        self.by_id[lora.lora_int_id] = lora
        return lora

    def remove(self, name: str) -> None:
        self._call(LoRACall(0, "remove", name))
        self.by_id = {i: lora for i, lora in self.by_id.items() if lora.lora_name != name}

    def _call(self, call: LoRACall) -> None:
        for reply in self.client.call_replicas(call):
            if reply.error is not None:
                raise (LoRANotFoundError if reply.not_found else ValueError)(reply.error)


class ReplicaSleep:
    """Sleep mode and weight updates on every replica, where LLM uses an EngineCore's EngineSleep.
    A replica's refusal is the caller's ValueError, naming the replica and where the call took
    effect (the replicas are asked together, as the PD router asks its instances)."""

    def __init__(self, client: DataParallelEngineClient):
        self.client = client
        self.level = 0

    def sleep(self, level: int) -> None:
        self._call(SleepCall(0, "sleep", level))

    def wake_up(self) -> None:
        self._call(SleepCall(0, "wake_up"))

    def update_weights(self, model_path: str, load_format: str = "auto") -> None:
        self._call(SleepCall(0, "update_weights", model_path=model_path, load_format=load_format))

    def reset_prefix_cache(self) -> bool:
        try:
            self._call(SleepCall(0, "reset_prefix_cache"))
        except ValueError:
            return False  # requests hold blocks on a replica (the others forgot theirs: no harm)
        return True

    def _call(self, call: SleepCall) -> None:
        replies = self.client.call_replicas(call)
        self.level = max(reply.sleep_level for reply in replies)
        failed = [(i, reply.error) for i, reply in enumerate(replies) if reply.error is not None]
        if failed:
            done = [str(i) for i, reply in enumerate(replies) if reply.error is None]
            where = f"; it took effect on replica(s) {', '.join(done)}" if done else ""
            raise ValueError(f"Data-parallel replica {failed[0][0]}: {failed[0][1]}{where}")


def replica_environments(config: EngineConfig, size: int) -> list[dict[str, str]]:
    """Each replica's environment: its rank (SPLITSERVE_DATA_PARALLEL_RANK: its KV events sockets
    are offset by it) and its share of the machine: its CPU cores, or its GPUs (world_size of them);
    with Ray actors as the ranks, Ray gives each its share wherever it places it."""
    return [{RANK_ENV: str(rank), **env} for rank, env in enumerate(_replica_shares(config, size))]


def _replica_shares(config: EngineConfig, size: int) -> list[dict[str, str]]:
    if config.parallel_config.distributed_executor_backend == "ray":
        return [{} for _ in range(size)]
    if config.device.type == "cuda":
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible:
            devices = [d for d in visible.split(",") if d.strip()]
        else:
            import torch

            devices = [str(i) for i in range(torch.cuda.device_count())]
        world = config.parallel_config.world_size
        if len(devices) < size * world:
            raise ValueError(
                f"data_parallel_size={size} replicas of {world} GPU(s) each need {size * world} GPUs; "
                f"{len(devices)} are visible."
            )
        return [{"CUDA_VISIBLE_DEVICES": ",".join(devices[i * world : (i + 1) * world])} for i in range(size)]
    shares = split_cores(size, available_cores())
    return [{CPU_CORES_ENV: ",".join(map(str, share))} for share in shares]

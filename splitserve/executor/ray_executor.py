"""One Ray actor per rank (vLLM's `ray` backend): on this machine, or across the machines that
joined one Ray cluster (`ray start --head` on one, `ray start --address HEAD:PORT` on the others;
the engine joins through RAY_ADDRESS, see docs/parallel.md).

The actors are placed in a placement group (one bundle per rank, packed onto as few machines as
hold them), join the process groups through a TCP store on rank 0's machine, and run the same
Worker as the multiprocess backend; every message is sent to every actor in order. An actor that
dies (or a rank that raises) fails the engine naming the rank; the actors are owned by the engine
process, so Ray ends them when it ends, and shutdown kills them.
"""

from __future__ import annotations

import logging
import os

from splitserve import envs
from splitserve.config import EngineConfig
from splitserve.distributed import ParallelRank
from splitserve.executor.abstract import Executor
from splitserve.executor.multiproc_executor import RankDiedError
from splitserve.executor.step_input import ModelRunnerOutput, StepInput
from splitserve.executor.worker import ENCODER, REPLY_DECODER, Call, Collect, Launch, WorkerReply

logger = logging.getLogger(__name__)

_CALL_TIMEOUT_S = 900.0


class RayWorker:
    """The actor: a Worker built once the process groups' address is known."""

    def __init__(self, cpus: int):
        import torch

        torch.set_num_threads(cpus)
        self.worker = None

    def node(self) -> tuple[str, str]:
        """(IP address, Ray node id) of the machine (the Ray node) this actor runs on."""
        import ray

        return ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id()

    def free_port(self) -> int:
        import socket

        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def start(self, config: EngineConfig, rank: ParallelRank, init_method: str, kv_host: str | None) -> int:
        from splitserve.executor.worker import Worker

        logging.basicConfig(
            level=envs.SPLITSERVE_LOGGING_LEVEL.upper(),
            format=f"%(asctime)s %(levelname)s rank-{rank.rank}: %(message)s",
        )
        # Ray gives each actor its own GPU, so it is device 0 here.
        self.worker = Worker(config, rank, init_method, local_rank=0, kv_host=kv_host)
        return rank.rank

    def handle(self, payload: bytes) -> bytes | None:
        return self.worker.handle(payload)


class RayDistributedExecutor(Executor):
    def __init__(self, config: EngineConfig):
        super().__init__(config)
        import ray

        pc = config.parallel_config
        self.world_size = pc.world_size
        self.ranks = [
            ParallelRank.of(r, pc.tensor_parallel_size, pc.pipeline_parallel_size) for r in range(self.world_size)
        ]
        self.output_rank = next(r.rank for r in self.ranks if r.is_output_rank)
        self.started_ray = not ray.is_initialized()
        if self.started_ray:
            ray.init(address=os.environ.get("RAY_ADDRESS"), log_to_driver=True)
        self.placement_group = None
        self.actors: list = []
        try:
            self._start_actors(config)
        except BaseException:
            self.shutdown()
            raise
        logger.info(
            "%d ranks ready on Ray (tensor parallel %d x pipeline parallel %d) on %d nodes: %s",
            self.world_size,
            pc.tensor_parallel_size,
            pc.pipeline_parallel_size,
            len(set(self.node_ids)),
            ", ".join(f"rank {r} on {ip}" for r, ip in enumerate(self.node_ips)),
        )

    def _bundle(self, config: EngineConfig) -> dict[str, float]:
        cpus = envs.SPLITSERVE_RAY_CPUS_PER_RANK
        return {"CPU": cpus, "GPU": 1} if config.device.type == "cuda" else {"CPU": cpus}

    def _start_actors(self, config: EngineConfig) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = self._bundle(config)
        self.placement_group = placement_group([bundle] * self.world_size, strategy="PACK")
        ready, _ = ray.wait([self.placement_group.ready()], timeout=_CALL_TIMEOUT_S)
        if not ready:
            raise RuntimeError(
                f"Ray could not place {self.world_size} ranks of {bundle} each within "
                f"{_CALL_TIMEOUT_S:.0f} s; the cluster has {ray.cluster_resources()}."
            )
        actor_class = ray.remote(RayWorker)
        for r in range(self.world_size):
            strategy = PlacementGroupSchedulingStrategy(self.placement_group, placement_group_bundle_index=r)
            self.actors.append(
                actor_class.options(
                    num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), scheduling_strategy=strategy
                ).remote(bundle["CPU"])
            )
        self.node_ips, self.node_ids = zip(*self._get([a.node.remote() for a in self.actors]))
        port = self._get([self.actors[0].free_port.remote()])[0]
        init_method = f"tcp://{self.node_ips[0]}:{port}"
        # Across machines, each rank's KV connector listens on its own machine's address.
        spread = len(set(self.node_ids)) > 1
        self._get(
            [
                a.start.remote(config, rank, init_method, self.node_ips[r] if spread else None)
                for r, (a, rank) in enumerate(zip(self.actors, self.ranks))
            ]
        )

    # --- messages ---------------------------------------------------------------------------
    def _get(self, refs: list, timeout: float | None = _CALL_TIMEOUT_S) -> list:
        """ray.get, with an actor's death or failure turned into a RankDiedError naming the rank."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        values = []
        for rank, ref in enumerate(refs):
            try:
                values.append(ray.get(ref, timeout=timeout))
            except RayActorError as exc:
                raise RankDiedError(f"rank {rank} ({self.ranks[rank]}): its Ray actor died: {exc}") from None
            except RayTaskError as exc:
                raise RankDiedError(f"rank {rank} ({self.ranks[rank]}) failed: {exc}") from None
            except GetTimeoutError:
                raise RankDiedError(f"rank {rank} ({self.ranks[rank]}) did not answer within {timeout:.0f} s") from None
        return values

    def _send_all(self, message) -> list:
        payload = ENCODER.encode(message)
        return [actor.handle.remote(payload) for actor in self.actors]

    def _expect_all(self, refs: list) -> list[WorkerReply]:
        replies = [REPLY_DECODER.decode(raw) for raw in self._get(refs, timeout=None)]
        for reply in replies:
            if reply.error is not None:
                raise RankDiedError(reply.error)
        return replies

    def collective_rpc(self, method: str, *args) -> list:
        return [reply.value for reply in self._expect_all(self._send_all(Call(method, list(args))))]

    # --- the Executor interface -------------------------------------------------------------
    def launch(self, step_input: StepInput) -> None:
        self._send_all(Launch(step_input))  # answered by nothing: a failure is the next answer

    def collect(self, handle: None) -> ModelRunnerOutput:
        return self._expect_all(self._send_all(Collect()))[self.output_rank].output

    def check_health(self) -> None:
        self.collective_rpc("ready")

    def shutdown(self) -> None:
        import ray

        if self.actors:
            self._wait_for_disk_tier()
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []
        if self.placement_group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.placement_group)
            self.placement_group = None
        if self.started_ray and ray.is_initialized():
            ray.shutdown()

"""The executor a configuration asks for (its implementations import the interface, so the choice
lives apart from it)."""

from __future__ import annotations

from splitserve.config import EngineConfig
from splitserve.executor.abstract import Executor


def create_executor(config: EngineConfig) -> Executor:
    backend = config.parallel_config.distributed_executor_backend
    if backend == "uni":
        from splitserve.executor.uniproc_executor import UniProcExecutor

        return UniProcExecutor(config)
    if backend == "mp":
        from splitserve.executor.multiproc_executor import MultiprocExecutor

        return MultiprocExecutor(config)
    from splitserve.executor.ray_executor import RayDistributedExecutor

    return RayDistributedExecutor(config)

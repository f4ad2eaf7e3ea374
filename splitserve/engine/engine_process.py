"""Starting the engine core process, in a module that does not import torch: `splitserve serve`
starts its engine process before its own imports of torch and transformers, so that the two
processes import them side by side (loader/config_cache.py and the start-up section of
docs/cpu-performance.md). The engine process itself runs engine/core_proc.py."""

from __future__ import annotations

import multiprocessing
import os
import tempfile
import uuid
from dataclasses import dataclass

from splitserve.config import EngineConfig
from splitserve.engine.arg_utils import EngineArgs


def new_ipc_address() -> str:
    return f"ipc://{tempfile.gettempdir()}/splitserve-engine-{uuid.uuid4().hex[:12]}.sock"


@dataclass
class DeferredEngineConfig:
    """Engine arguments the engine process turns into its EngineConfig itself. The server starts its
    engine process first and builds its own copy of the config meanwhile, so that the two imports of
    torch and transformers (about 1.5 s in a fresh interpreter) overlap instead of following each
    other. Both copies come from the same arguments, in the same environment."""

    engine_args: EngineArgs
    health_timeout: float

    def build(self) -> EngineConfig:
        config = self.engine_args.create_engine_config()
        config.health_timeout = self.health_timeout
        return config


class EngineProcess:
    """Starts the engine core process and waits until it is ready (or says why it is not)."""

    def __init__(self, source: EngineConfig | DeferredEngineConfig, address: str | None = None):
        self.address = address or new_ipc_address()
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe(duplex=False)
        # Not a daemon: daemonic processes may not start children, and the engine starts one worker
        # process per rank with tensor/pipeline parallelism. It still never outlives this process
        # (a parent-death signal, and shutdown() below).
        self.process = ctx.Process(
            target=_run_engine_core, args=(source, self.address, child), name="splitserve-engine"
        )
        self.process.start()
        child.close()
        self._ready_pipe = parent

    def wait_ready(self, config: EngineConfig) -> None:
        """Until the engine process has built its engine (it starts meanwhile: the caller may do
        other work first); raises with the engine's reason if it failed. Copies what the engine
        decided at start-up (the KV cache's size) into the caller's `config`."""
        try:
            ready = self._ready_pipe.recv()
        except EOFError:
            raise RuntimeError("The engine process exited during start-up; see its log above.") from None
        if ready["status"] != "ready":
            raise RuntimeError(f"The engine failed to start: {ready['error']}")
        config.cache_config.num_gpu_blocks = ready["num_gpu_blocks"]

    @property
    def pid(self) -> int:
        return self.process.pid

    def shutdown(self) -> None:
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout=5)
        if self.process.is_alive():
            self.process.kill()
        if self.address.startswith("ipc://") and os.path.exists(self.address[len("ipc://") :]):
            os.unlink(self.address[len("ipc://") :])


def _run_engine_core(source: EngineConfig | DeferredEngineConfig, address: str, ready_pipe) -> None:
    from splitserve.engine.core_proc import run_engine_core

    run_engine_core(source, address, ready_pipe)

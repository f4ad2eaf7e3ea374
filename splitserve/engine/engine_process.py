"""Starting the engine core process, in a module that does not import torch. On the CPU, `splitserve
serve` builds its config and then forks its engine process from itself (config_for_fork): the engine
starts with torch, transformers and the config already in memory. Where the engine runs on a GPU (or
SPLITSERVE_ENGINE_START_METHOD=spawn), the engine process is spawned first, before the server's own
imports of torch and transformers, so that the two processes import them side by side
(loader/config_cache.py and the start-up section of docs/cpu-performance.md). The engine process
itself runs engine/core/core_proc.py."""

from __future__ import annotations

import multiprocessing
import os
import signal
import tempfile
import threading
import uuid
from dataclasses import dataclass

from splitserve import envs
from splitserve.config import EngineConfig
from splitserve.engine.arg_utils import EngineArgs
from splitserve.process_utils import nvidia_driver_present, os_threads


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


def fork_wanted(data_parallel_size: int) -> bool:
    """Whether a server should build its config first and then fork its engine process from itself
    (SPLITSERVE_ENGINE_START_METHOD, docs/envs.md): a forked engine starts with torch, transformers and
    the config already in memory, where a spawned one imports them again (about 2 s of CPU in a fresh
    interpreter). `auto` forks on hosts without an NVIDIA driver only: CUDA does not survive a fork of a
    process that touched it, and there the engine is spawned first, its imports overlapping the
    server's (DeferredEngineConfig). Data-parallel replicas are spawned (each sets its share of the
    cores in its environment before torch is imported)."""
    method = envs.SPLITSERVE_ENGINE_START_METHOD
    if method == "spawn" or data_parallel_size > 1:
        return False
    return method == "fork" or not nvidia_driver_present()


def config_for_fork(engine_args: EngineArgs) -> tuple[EngineConfig, str | None]:
    """Build the engine's config in this process, for an engine forked from it: the config, and why the
    engine must be spawned after all (None: it may be forked)."""
    import torch  # noqa: F401 (with numpy: their idle thread pools, which fork safely, are not counted)

    before = os_threads()
    config = engine_args.create_engine_config()
    if config.device.type != "cpu":
        return config, f"the engine runs on {config.device.type}, which does not survive a fork"
    started = os_threads() - before
    if threading.active_count() > 1 or started:
        # e.g. OpenMP's pool, started by a parallel op: a forked child's next parallel region would hang
        return config, f"this process started {len(started) or threading.active_count() - 1} threads a fork would lose"
    return config, None


class EngineProcess:
    """Starts the engine core process and waits until it is ready (or says why it is not). The
    process's standard error (its log, and its ranks') also goes to a file, so that once it has died
    its last lines can say why (`last_log_lines`)."""

    def __init__(
        self,
        source: EngineConfig | DeferredEngineConfig,
        address: str | None = None,
        env: dict[str, str] | None = None,
        fork_closing: tuple[int, ...] | None = None,
    ):
        """`env`: set in the engine process's environment before anything else runs there (a data-parallel
        replica's share of the CPU cores or GPUs). `fork_closing`: fork this process (an EngineConfig
        source; config_for_fork found no hazard) and close these file descriptors (the server's listening
        sockets) in the engine at once; None: spawn a fresh interpreter."""
        self.address = address or new_ipc_address()
        ctx = multiprocessing.get_context("spawn" if fork_closing is None else "fork")
        parent, child = ctx.Pipe(duplex=False)
        fd, self.log_path = tempfile.mkstemp(prefix="splitserve-engine-", suffix=".log")
        os.close(fd)
        # Not a daemon: daemonic processes may not start children, and the engine starts one worker
        # process per rank with tensor/pipeline parallelism. It still never outlives this process
        # (a parent-death signal, and shutdown() below).
        self.process = ctx.Process(
            target=_run_engine_core,
            args=(source, self.address, child, self.log_path, env or {}, fork_closing),
            name="splitserve-engine",
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

    def is_alive(self) -> bool:
        return self.process.is_alive()

    def describe_exit(self) -> str:
        """How the process ended, in words: "killed by signal 9 (SIGKILL)", "exit code 1"."""
        code = self.process.exitcode
        if code is None:
            return "still running"
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = "unknown signal"
            return f"killed by signal {-code} ({name})"
        return f"exit code {code}"

    def last_log_lines(self, count: int = 10) -> list[str]:
        """The last lines the engine process (or one of its ranks) wrote to standard error."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(os.path.getsize(self.log_path) - 16384, 0))
                lines = f.read().decode("utf-8", "replace").splitlines()
        except OSError:
            return []
        return [line for line in lines if line.strip()][-count:]

    def shutdown(self) -> None:
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout=5)
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5)
        if self.address.startswith("ipc://") and os.path.exists(self.address[len("ipc://") :]):
            os.unlink(self.address[len("ipc://") :])
        if os.path.exists(self.log_path):
            os.unlink(self.log_path)


_LOG_FILE_MAX_BYTES = 1 << 20  # the copy of the engine's standard error is cut back to its tail past this
_LOG_FILE_KEEP_BYTES = 64 << 10


def _tee_stderr(path: str) -> None:
    """In the engine process: what is written to file descriptor 2 (Python's log and tracebacks, C++
    messages, the ranks' output, which inherit it) still reaches the terminal, and also the file at
    `path`, written as it comes, so that it holds the last lines even after a SIGKILL. The file is cut
    back to its last 64 KiB when it passes 1 MiB."""
    read_end, write_end = os.pipe()
    terminal = os.dup(2)
    os.dup2(write_end, 2)
    os.close(write_end)

    def copy() -> None:
        tail = bytearray()
        with open(path, "wb", buffering=0) as log:
            while chunk := os.read(read_end, 65536):
                try:
                    os.write(terminal, chunk)
                except OSError:
                    pass
                log.write(chunk)
                tail += chunk
                del tail[: max(len(tail) - _LOG_FILE_KEEP_BYTES, 0)]
                if log.tell() > _LOG_FILE_MAX_BYTES:
                    log.seek(0)
                    log.truncate()
                    log.write(bytes(tail))

    threading.Thread(target=copy, name="stderr-copy", daemon=True).start()


def _run_engine_core(
    source: EngineConfig | DeferredEngineConfig,
    address: str,
    ready_pipe,
    log_path: str,
    env: dict[str, str],
    closing: tuple[int, ...] | None,
) -> None:
    if closing is not None:  # forked: the server's port must not stay open in the engine, nor its phases in its report
        from splitserve.engine import startup

        for fd in closing:
            os.close(fd)
        startup.forget()
    os.environ.update(env)
    from splitserve.engine.core.core_proc import run_engine_core

    _tee_stderr(log_path)
    run_engine_core(source, address, ready_pipe, forked_from_server=closing is not None)

"""One worker process per rank on this machine (vLLM's `mp` backend).

The engine core process starts the workers (each exiting with its parent: forked on the CPU from an
engine that runs no native thread pool yet, as a server's forked engine, else spawned), each joins the
process groups through a loopback TCP store and builds its share of the model; then every step is
encoded once and written to every worker's pipe. On CPU each rank is pinned to its own share of
the cores (one torch thread per core); with fewer cores than ranks they share them, slower, with
a warning. A worker that dies or raises fails the engine at once with a message naming its rank,
and the workers never outlive the engine (parent-death signal, and a kill at shutdown).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import time
import weakref
from multiprocessing.connection import Connection, wait

from splitserve import envs
from splitserve.config import EngineConfig
from splitserve.distributed import ParallelRank
from splitserve.executor.abstract import Executor
from splitserve.executor.cpu_binding import available_cores, bind_cpu_cores, split_cores
from splitserve.executor.step_input import ModelRunnerOutput, StepInput
from splitserve.executor.worker import ENCODER, REPLY_DECODER, Call, Collect, Launch, Worker, WorkerReply
from splitserve.process_utils import exit_with_parent, free_port, native_threads, set_process_name

logger = logging.getLogger(__name__)

_START_TIMEOUT_S = 900.0


class RankDiedError(RuntimeError):
    """A rank's process ended or a rank raised: the engine cannot go on."""


def _worker_main(
    config: EngineConfig,
    rank: ParallelRank,
    init_method: str,
    conn: Connection,
    cores: list[int] | None,
    closing: tuple[int, ...] = (),
) -> None:
    """A worker process: join, build, then answer messages until the pipe closes. `closing`: the
    descriptors a forked rank closes (the engine's ends of the ranks' pipes: each rank must see its own
    pipe close when the engine goes)."""
    for fd in closing:
        os.close(fd)
    exit_with_parent()
    set_process_name(f"splitserve-r{rank.rank}")
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    logging.basicConfig(  # force: a forked rank inherits the engine's handler and format
        level=envs.SPLITSERVE_LOGGING_LEVEL.upper(),
        format=f"%(asctime)s %(levelname)s rank-{rank.rank}: %(message)s",
        force=True,
    )
    if cores:
        bind_cpu_cores(cores)
    try:
        worker = Worker(config, rank, init_method, local_rank=rank.rank)
    except Exception as exc:
        logger.exception("Rank %d failed to start", rank.rank)
        conn.send_bytes(
            ENCODER.encode(WorkerReply(error=f"rank {rank.rank} failed to start: {type(exc).__name__}: {exc}"))
        )
        return
    conn.send_bytes(ENCODER.encode(WorkerReply(value=rank.rank)))
    while True:
        try:
            payload = conn.recv_bytes()
        except EOFError:
            return
        reply = worker.handle(payload)
        if reply is not None:
            conn.send_bytes(reply)


def _fork_ranks(config: EngineConfig) -> bool:
    """Fork the ranks from this engine process (they start with its imports and config, about 2 s of CPU
    less each than a fresh interpreter) when they run on the CPU and no native thread pool runs here
    yet; else spawn them (CUDA does not survive a fork; SPLITSERVE_ENGINE_START_METHOD=spawn)."""
    if config.device.type != "cpu" or envs.SPLITSERVE_ENGINE_START_METHOD == "spawn":
        return False
    if (count := native_threads()) > 0:
        logger.info("The ranks are spawned, not forked: this process already runs %d native threads", count)
        return False
    return True


# The ranks meet on a port found free, which another process can take before rank 0 listens on it.
_PORT_ATTEMPTS = 3


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig):
        super().__init__(config)
        pc = config.parallel_config
        self.world_size = pc.world_size
        self.ranks = [
            ParallelRank.of(r, pc.tensor_parallel_size, pc.pipeline_parallel_size) for r in range(self.world_size)
        ]
        self.output_rank = next(r.rank for r in self.ranks if r.is_output_rank)
        self.processes: list[multiprocessing.Process] = []
        self.conns: list[Connection] = []
        # Workers stop when this executor is collected (an LLM dropped without shutdown) or at exit.
        weakref.finalize(self, _stop_workers, self.processes, self.conns)
        for attempt in range(_PORT_ATTEMPTS):
            try:
                self._start_workers(config)
                self._expect_all(_START_TIMEOUT_S)
                break
            except RankDiedError as exc:
                self.shutdown()
                if "EADDRINUSE" not in str(exc) or attempt == _PORT_ATTEMPTS - 1:
                    raise
                logger.warning(
                    "Another process took the ranks' meeting port before rank 0 listened on it; "
                    "starting the ranks again on another port"
                )
                self.processes.clear()
                self.conns.clear()
            except BaseException:
                self.shutdown()
                raise
        logger.info(
            "%d ranks ready (tensor parallel %d x pipeline parallel %d), one process each",
            self.world_size,
            pc.tensor_parallel_size,
            pc.pipeline_parallel_size,
        )

    def _start_workers(self, config: EngineConfig) -> None:
        init_method = f"tcp://127.0.0.1:{free_port()}"
        cores = self._cores(config)
        fork = _fork_ranks(config)
        ctx = multiprocessing.get_context("fork" if fork else "spawn")
        for rank in self.ranks:
            parent, child = ctx.Pipe()
            closing = tuple(c.fileno() for c in [*self.conns, parent]) if fork else ()
            process = ctx.Process(
                target=_worker_main,
                name=f"splitserve-rank-{rank.rank}",
                daemon=True,
                args=(config, rank, init_method, child, cores[rank.rank] if cores else None, closing),
            )
            process.start()
            child.close()
            self.processes.append(process)
            self.conns.append(parent)

    def _cores(self, config: EngineConfig) -> list[list[int]] | None:
        if config.device.type != "cpu":
            return None
        cores = available_cores()
        if len(cores) < self.world_size:
            logger.warning(
                "%d ranks share %d CPU cores: each rank gets one, and ranks on the same core slow each other down",
                self.world_size,
                len(cores),
            )
        split = split_cores(self.world_size, cores)
        logger.info("CPU cores per rank: %s", "; ".join(f"rank {r}: {c}" for r, c in enumerate(split)))
        return split

    # --- messages ---------------------------------------------------------------------------
    def _send_all(self, message) -> None:
        payload = ENCODER.encode(message)
        for rank, conn in enumerate(self.conns):
            try:
                conn.send_bytes(payload)
            except (BrokenPipeError, OSError):
                raise self._died(rank) from None

    def _expect_all(self, timeout: float | None = None) -> list[WorkerReply]:
        """One answer from every rank, in rank order; a rank that died or raised fails the engine."""
        replies: dict[int, WorkerReply] = {}
        pending = dict(enumerate(self.conns))
        while pending:
            sentinels = {self.processes[r].sentinel: r for r in pending}
            ready = wait(list(pending.values()) + list(sentinels), timeout)
            if not ready:
                raise RankDiedError(f"ranks {sorted(pending)} did not answer within {timeout:.0f} s")
            for obj in ready:
                if obj in sentinels:
                    rank = sentinels[obj]
                    if rank in pending and not pending[rank].poll():
                        raise self._died(rank)
                    continue
                rank = next(r for r, c in pending.items() if c is obj)
                replies[rank] = self._read(rank)
                del pending[rank]
        return [replies[r] for r in range(self.world_size)]

    def _read(self, rank: int) -> WorkerReply:
        try:
            reply = REPLY_DECODER.decode(self.conns[rank].recv_bytes())
        except (EOFError, OSError):
            raise self._died(rank) from None
        if reply.error is not None:
            dead = self._ended_rank(other_than=rank)
            if dead is not None:  # it failed waiting for a rank that had died (a collective): name the cause
                raise RankDiedError(f"{self._died(dead)}; rank {rank} then failed: {reply.error}")
            raise RankDiedError(reply.error)
        return reply

    def _ended_rank(self, other_than: int, wait_s: float = 1.0) -> int | None:
        """A rank whose process has ended, looked for during wait_s: a rank that died mid-step makes its
        peers fail in their collectives, whose error can arrive before its own end is seen."""
        deadline = time.monotonic() + wait_s
        while True:
            ended = [r for r, p in enumerate(self.processes) if r != other_than and p.exitcode is not None]
            if ended or time.monotonic() >= deadline:
                return ended[0] if ended else None
            time.sleep(0.05)

    def _died(self, rank: int) -> RankDiedError:
        process = self.processes[rank]
        process.join(timeout=1)
        code = process.exitcode
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        return RankDiedError(f"rank {rank} ({self.ranks[rank]}) {how}")

    def collective_rpc(self, method: str, *args) -> list:
        self._send_all(Call(method, list(args)))
        return [reply.value for reply in self._expect_all()]

    # --- the Executor interface -------------------------------------------------------------
    def launch(self, step_input: StepInput) -> None:
        self._send_all(Launch(step_input))

    def collect(self, handle: None) -> ModelRunnerOutput:
        self._send_all(Collect())
        return self._expect_all()[self.output_rank].output

    def check_health(self) -> None:
        for rank, process in enumerate(self.processes):
            if not process.is_alive():
                raise self._died(rank)

    def shutdown(self) -> None:
        if all(p.is_alive() for p in self.processes):
            self._wait_for_disk_tier()
        _stop_workers(self.processes, self.conns)


def _stop_workers(processes: list[multiprocessing.Process], conns: list[Connection]) -> None:
    for conn in conns:
        conn.close()
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(timeout=5)
        if process.is_alive():
            process.kill()
            process.join(timeout=5)

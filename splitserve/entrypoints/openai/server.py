"""The processes of one OpenAI-compatible server instance.

The parent process starts the engine core process (with `--data-parallel-size N`, one per replica,
each with its share of the cores or GPUs), binds the listening socket, and then serves HTTP itself
(one worker) or starts `--workers` API processes that share the socket and each talk to the
engines over ZMQ. `--metrics-port`, when it differs from `--port`, serves /metrics alone.
The process that started the engines also restarts each when it dies (engine/supervisor.py), and
exits non-zero once it has given up on one (`--max-engine-restarts`).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile

from splitserve import envs
from splitserve.config import EngineConfig
from splitserve.engine import startup
from splitserve.engine.arg_utils import EngineArgs
from splitserve.entrypoints.openai.api_processes import start_api_workers
from splitserve.entrypoints.openai.args import ServerArgs
from splitserve.loader.generation_config import describe as describe_sampling_defaults
from splitserve.process_utils import leaving, os_threads, unwind_on_sigterm

logger = logging.getLogger("splitserve.api_server")


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def run_server(engine_args: EngineArgs, server_args: ServerArgs) -> None:
    from splitserve.engine.engine_process import DeferredEngineConfig, EngineProcess, fork_wanted

    multiproc_dir = None
    if server_args.workers > 1:
        from splitserve.entrypoints.openai.metrics import MULTIPROC_ENV

        # Must be set before any process imports prometheus_client.
        multiproc_dir = tempfile.mkdtemp(prefix="splitserve-metrics-")
        os.environ[MULTIPROC_ENV] = multiproc_dir
    batch_dir = None
    if server_args.batch_files_dir is None:  # made here, so that every API worker shares it
        batch_dir = server_args.batch_files_dir = tempfile.mkdtemp(prefix="splitserve-batches-")
    sock = bind_socket(server_args.host, server_args.port)
    metrics_sock = None
    if server_args.metrics_port not in (None, server_args.port):
        metrics_sock = bind_socket(server_args.host, server_args.metrics_port)
    unwind_on_sigterm()  # through `finally`: the engine and the workers are stopped with this process
    engines: list[EngineProcess] = []
    workers: list[multiprocessing.Process] = []
    supervisors = []
    try:
        # Spawned engine processes build their config from the same arguments while this one builds its
        # own (with data parallelism, after it: each replica's share of the cores or GPUs depends on it);
        # a forked one (on the CPU) starts from this process's config and imports.
        config, closing, fork_baseline = None, None, None
        if fork_wanted(engine_args.data_parallel_size):
            config, closing = _config_for_fork(engine_args, [s for s in (sock, metrics_sock) if s is not None])
            fork_baseline = os_threads() if closing is not None else None  # API workers may fork too
        elif engine_args.data_parallel_size > 1:
            config = engine_args.create_engine_config()
        if config is not None:
            config.health_timeout = server_args.health_timeout
        replica_envs = _replica_environments(config if engine_args.data_parallel_size > 1 else None)
        for i, env in enumerate(replica_envs):
            source = config if closing is not None else DeferredEngineConfig(engine_args, server_args.health_timeout)
            engines.append(EngineProcess(source, _engine_address(server_args, i), env, closing))
        from splitserve.tokenizer import get_tokenizer  # torch and transformers: after the engine has started

        config = config or engine_args.create_engine_config()
        config.health_timeout = server_args.health_timeout
        logger.info("Default sampling: %s", describe_sampling_defaults(config.model_config.sampling_defaults))
        with startup.phase("tokenizer"):  # while the engine process starts (serve_worker's front-end finds it)
            get_tokenizer(config.model_config.tokenizer, config.model_config.trust_remote_code)
        if server_args.workers == 1:
            with startup.phase("API modules"):  # serve_worker's, also while the engine process starts
                import uvicorn  # noqa: F401

                import splitserve.engine.async_llm  # noqa: F401
                import splitserve.entrypoints.openai.app  # noqa: F401
        with startup.phase("engine process"):
            for engine in engines:
                engine.wait_ready(config)
        supervisors = _engine_supervisors(engines, replica_envs, engine_args, server_args, config)
        addresses = [engine.address for engine in engines]
        if server_args.workers == 1:
            serve_worker(config, server_args, addresses, 0, sock, metrics_sock, supervisors)
        else:
            watches = [s.watch for s in supervisors]
            worker_args = lambda i: (config, server_args, addresses, i, sock, None, None, watches)  # noqa: E731
            workers = start_api_workers(serve_worker, worker_args, server_args.workers, fork_baseline)
            _supervise(workers, supervisors, server_args, metrics_sock)
        if any(s.gave_up is not None for s in supervisors):
            raise SystemExit(1)
    finally:
        leaving()
        for w in workers:
            if w.is_alive():
                w.terminate()
        for engine in [s.engine for s in supervisors] if supervisors else engines:
            engine.shutdown()
        for directory in (multiproc_dir, batch_dir):
            if directory:
                shutil.rmtree(directory, ignore_errors=True)


def refuse_data_parallel(engine_args: EngineArgs) -> None:
    """For the tools that drive one engine process (run-batch)."""
    if engine_args.data_parallel_size > 1:
        raise ValueError(
            "run-batch drives one engine replica: --data-parallel-size is for `splitserve serve` and the "
            "offline LLM(data_parallel_size=N) (docs/scaling.md)."
        )


def _replica_environments(config: EngineConfig | None) -> list[dict[str, str] | None]:
    """Each engine replica's share of the cores or GPUs ([None]: one replica, the whole machine,
    whose config is built while its engine starts)."""
    if config is None:
        return [None]
    from splitserve.engine.dp_client import replica_environments

    envs = replica_environments(config, config.parallel_config.data_parallel_size)
    logger.info("Data parallelism: %d engine replicas (%s)", len(envs), "; ".join(map(str, envs)))
    return envs


def _config_for_fork(engine_args: EngineArgs, sockets: list[socket.socket]) -> tuple[EngineConfig, tuple | None]:
    """The config, built here, and the descriptors a forked engine process closes (this process's
    listening sockets); None when the engine must be spawned after all (said in the log, with the reason)."""
    from splitserve.engine.engine_process import config_for_fork

    config, hazard = config_for_fork(engine_args)
    if hazard is not None:
        logger.info("The engine process is spawned (a fresh interpreter), not forked: %s", hazard)
        return config, None
    logger.info("The engine process is forked from this one (torch, transformers and the config already loaded)")
    return config, tuple(s.fileno() for s in sockets)


def _engine_address(server_args: ServerArgs, replica: int) -> str | None:
    if server_args.engine_worker_queue_port is None:
        return None  # a fresh IPC socket
    return f"tcp://127.0.0.1:{server_args.engine_worker_queue_port + replica}"


def _engine_supervisors(engines, replica_envs, engine_args: EngineArgs, server_args: ServerArgs, config: EngineConfig):
    """What restarts each engine replica with the arguments it was started with, counted in /metrics."""
    from splitserve.engine.engine_process import DeferredEngineConfig, EngineProcess
    from splitserve.engine.supervisor import EngineSupervisor
    from splitserve.entrypoints.openai.metrics import engine_restarts_counter

    restarts = engine_restarts_counter(config.model_config.served_model_name, server_args.metrics_prefix)

    def starter(address: str, env):
        return lambda: EngineProcess(DeferredEngineConfig(engine_args, server_args.health_timeout), address, env)

    return [
        EngineSupervisor(
            engine,
            starter(engine.address, env),
            config,
            server_args.max_engine_restarts,
            server_args.engine_restart_window,
            on_restart=restarts.inc,
        )
        for engine, env in zip(engines, replica_envs)
    ]


def _supervise(workers, supervisors, server_args: ServerArgs, metrics_sock) -> None:
    """The parent of several workers: restart the engines when they die, serve the separate metrics
    port if any, and wait until a signal, a worker's exit, or a supervisor giving up ends it."""
    stop = asyncio.Event()

    async def watch_workers() -> None:
        while not stop.is_set() and all(w.is_alive() for w in workers):
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except asyncio.TimeoutError:
                pass

    async def main() -> None:
        stopping = stop.is_set
        tasks = [asyncio.ensure_future(watch_workers())]
        if metrics_sock is not None:  # uvicorn takes the signals, and ends with them
            import uvicorn

            from splitserve.entrypoints.openai.app import build_metrics_app

            config = uvicorn.Config(build_metrics_app(server_args), log_level=server_args.uvicorn_log_level)
            metrics_server = uvicorn.Server(config)
            stopping = lambda: metrics_server.should_exit  # noqa: E731
            tasks.append(asyncio.ensure_future(metrics_server.serve(sockets=[metrics_sock])))
        else:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
        for supervisor in supervisors:
            supervisor.stopping = stopping
            tasks.append(asyncio.ensure_future(supervisor.run()))
        _, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    asyncio.run(main())


def serve_worker(
    config: EngineConfig,
    server_args: ServerArgs,
    addresses: list[str],
    index: int,
    sock: socket.socket,
    metrics_sock: socket.socket | None,
    supervisors=None,
    watches=None,
) -> None:
    """One API server process: a front-end over the engine replicas (an AsyncLLM, with the global
    scheduler a GlobalSchedulerAsyncLLM, or with data parallelism a DataParallelAsyncLLM over one per
    replica) and uvicorn on the shared socket. With
    one worker, this process also runs the engines' `supervisors`; a worker of several follows the
    parent's restarts through `watches` (their EngineWatches)."""
    import uvicorn

    from splitserve.process_utils import exit_with_parent, set_process_name

    if multiprocessing.parent_process() is not None:  # a worker process of a multi-worker server
        exit_with_parent()
        set_process_name(f"splitserve-api{index}")
    _quiet_threads()
    logging.basicConfig(
        level=envs.SPLITSERVE_LOGGING_LEVEL.upper(), format=f"%(asctime)s %(levelname)s api-{index}: %(message)s"
    )
    from splitserve.engine.async_llm import AsyncLLM
    from splitserve.entrypoints.openai.app import build_app, build_metrics_app

    if supervisors is not None:
        watches = [s.watch for s in supervisors]
    global_scheduler = None
    if server_args.scheduler_name == "global":  # one replica: refused with data parallelism
        from splitserve.engine.global_scheduler import GlobalScheduler
        from splitserve.entrypoints.openai.scheduler_args import global_scheduler_config

        model, sched = config.model_config.served_model_name, config.scheduler_config
        global_scheduler = GlobalScheduler(
            global_scheduler_config(server_args), model, sched.max_num_seqs, sched.waiting_ttl
        )
    replicas = []
    for address, watch in zip(addresses, watches):
        tokenizer = replicas[0].tokenizer if replicas else None
        args = (config.model_config, address, watch.pid, index, watch, tokenizer)
        if global_scheduler is None:
            replicas.append(AsyncLLM(*args))
        else:
            from splitserve.engine.global_frontend import GlobalSchedulerAsyncLLM

            replicas.append(GlobalSchedulerAsyncLLM(global_scheduler, *args))
        replicas[-1].output_processor.stream_interval = server_args.stream_interval
    if len(replicas) == 1:
        engine = replicas[0]
    else:
        from splitserve.engine.dp_async_llm import DataParallelAsyncLLM

        engine = DataParallelAsyncLLM(replicas)
    engine.scheduling_policy = config.scheduler_config.policy
    app = build_app(engine, config, server_args, index)
    servers = [uvicorn.Server(uvicorn.Config(app, log_level=server_args.uvicorn_log_level, timeout_keep_alive=30))]
    sockets = [[sock]]
    if metrics_sock is not None:
        servers.append(
            uvicorn.Server(uvicorn.Config(build_metrics_app(server_args), log_level=server_args.uvicorn_log_level))
        )
        sockets.append([metrics_sock])
    startup.report("server" if index == 0 else f"server worker {index}")
    logger.info("Serving %s on http://%s:%d", config.model_config.served_model_name, server_args.host, server_args.port)

    async def serve_all() -> None:
        restarts = []
        for supervisor in supervisors or []:  # once one gives up, the server shuts down (and exits non-zero)
            supervisor.stopping = lambda: any(s.should_exit for s in servers)
            restarts.append(asyncio.ensure_future(supervisor.run()))
            restarts[-1].add_done_callback(lambda _: [setattr(s, "should_exit", True) for s in servers])
        if global_scheduler is not None:
            engine.start()  # pulls work from the other instances even before its own first request
        try:
            await asyncio.gather(*(s.serve(sockets=socks) for s, socks in zip(servers, sockets)))
        finally:
            if global_scheduler is not None:
                await global_scheduler.close()
            for task in restarts:
                task.cancel()
            await asyncio.gather(*restarts, return_exceptions=True)

    asyncio.run(serve_all())


def _quiet_threads() -> None:
    """API processes only tokenize and stream: keep their thread pools from competing with the
    engine process for the cores."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:
        pass

"""The processes of one OpenAI-compatible server instance.

The parent process starts the engine core process, binds the listening socket, and then serves
HTTP itself (one worker) or starts `--workers` API processes that share the socket and each talk
to the engine over ZMQ. `--metrics-port`, when it differs from `--port`, serves /metrics alone.
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
from splitserve.entrypoints.openai.args import ServerArgs
from splitserve.loader.generation_config import describe as describe_sampling_defaults

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
    from splitserve.engine.engine_process import DeferredEngineConfig, EngineProcess

    multiproc_dir = None
    if server_args.workers > 1:
        from splitserve.entrypoints.openai.metrics import MULTIPROC_ENV

        # Must be set before any process imports prometheus_client.
        multiproc_dir = tempfile.mkdtemp(prefix="splitserve-metrics-")
        os.environ[MULTIPROC_ENV] = multiproc_dir
    sock = bind_socket(server_args.host, server_args.port)
    metrics_sock = None
    if server_args.metrics_port not in (None, server_args.port):
        metrics_sock = bind_socket(server_args.host, server_args.metrics_port)
    address = None
    if server_args.engine_worker_queue_port is not None:
        address = f"tcp://127.0.0.1:{server_args.engine_worker_queue_port}"
    # uvicorn handles SIGTERM itself and, once it has shut down, raises the signal again for the
    # handler it found: make that handler unwind through `finally`, so the engine and the workers
    # are stopped instead of outliving this process. SIGHUP (the terminal went away) becomes a
    # SIGTERM, so that it stops them the same way rather than leave it to their parent-death signal.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    signal.signal(signal.SIGHUP, lambda *_: os.kill(os.getpid(), signal.SIGTERM))
    # The engine process builds its config from the same arguments while this one builds its own.
    engine = EngineProcess(DeferredEngineConfig(engine_args, server_args.health_timeout), address)
    from splitserve.tokenizer import get_tokenizer  # torch and transformers: after the engine has started

    workers: list[multiprocessing.Process] = []
    try:
        config = engine_args.create_engine_config()
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
            engine.wait_ready(config)
        if server_args.workers == 1:
            serve_worker(config, server_args, engine.address, engine.pid, 0, sock, metrics_sock)
        else:
            workers = _start_workers(config, server_args, engine.address, engine.pid, sock)
            _supervise(workers, engine, server_args, metrics_sock)
    finally:
        for w in workers:
            if w.is_alive():
                w.terminate()
        engine.shutdown()
        if multiproc_dir:
            shutil.rmtree(multiproc_dir, ignore_errors=True)


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def _start_workers(config, server_args, address, pid, sock) -> list[multiprocessing.Process]:
    ctx = multiprocessing.get_context("spawn")
    workers = []
    for index in range(server_args.workers):
        p = ctx.Process(
            target=serve_worker,
            args=(config, server_args, address, pid, index, sock, None),
            name=f"splitserve-api-{index}",
        )
        p.start()
        workers.append(p)
    logger.info("Started %d API server processes", len(workers))
    return workers


def _supervise(workers, engine, server_args: ServerArgs, metrics_sock) -> None:
    """The parent of several workers: serve the separate metrics port if any, and wait."""
    if metrics_sock is not None:
        import uvicorn

        from splitserve.entrypoints.openai.app import build_metrics_app

        uvicorn.Server(uvicorn.Config(build_metrics_app(server_args), log_level=server_args.uvicorn_log_level)).run(
            sockets=[metrics_sock]
        )
        return
    stop = asyncio.Event()

    async def wait() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        while not stop.is_set() and all(w.is_alive() for w in workers):
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except asyncio.TimeoutError:
                pass

    asyncio.run(wait())


def serve_worker(
    config: EngineConfig,
    server_args: ServerArgs,
    address: str,
    engine_pid: int,
    index: int,
    sock: socket.socket,
    metrics_sock: socket.socket | None,
) -> None:
    """One API server process: an AsyncLLM client and uvicorn on the shared socket."""
    import uvicorn

    from splitserve.process_utils import exit_with_parent

    if multiprocessing.parent_process() is not None:  # a worker process of a multi-worker server
        exit_with_parent()
    _quiet_threads()
    logging.basicConfig(
        level=envs.SPLITSERVE_LOGGING_LEVEL.upper(), format=f"%(asctime)s %(levelname)s api-{index}: %(message)s"
    )
    from splitserve.engine.async_llm import AsyncLLM
    from splitserve.entrypoints.openai.app import build_app, build_metrics_app

    engine = AsyncLLM(config.model_config, address, engine_pid, client_index=index)
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
        await asyncio.gather(*(s.serve(sockets=socks) for s, socks in zip(servers, sockets)))

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

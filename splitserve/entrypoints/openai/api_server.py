"""The OpenAI-compatible HTTP server.

    splitserve serve --model M --port 8188 --workers 2
    python -m splitserve.entrypoints.openai.api_server --model M --port 8188

The parent process starts the engine core process, binds the listening socket, and then serves
HTTP itself (one worker) or starts `--workers` API processes that share the socket and each talk
to the engine over ZMQ. `--metrics-port`, when it differs from `--port`, serves /metrics alone.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile

from splitserve.config import EngineArgs, EngineConfig

logger = logging.getLogger("splitserve.api_server")



@dataclasses.dataclass
class ServerArgs:
    """Options of the HTTP layer (the engine's are EngineArgs)."""

    host: str = "0.0.0.0"
    port: int = 8000
    metrics_port: int | None = None
    workers: int = 1
    api_key: str | None = None
    metrics_api_key: str | None = None
    chat_template: str | None = None
    max_queued_requests: int | None = None
    reasoning_parser: str | None = None
    use_warmup: bool = False
    disable_log_requests: bool = False
    health_timeout: float = 30.0
    engine_worker_queue_port: int | None = None
    pd: str | None = None
    policy: str = "round_robin"
    uvicorn_log_level: str = "warning"


def add_server_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="0.0.0.0")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--metrics-port", type=int, default=None, help="serve /metrics here too (default: --port only)")
    g.add_argument("--workers", "--api-server-count", dest="workers", type=int, default=1,
                   help="API server processes sharing the port")
    g.add_argument("--api-key", default=os.environ.get("SPLITSERVE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every route except /health and /metrics")
    g.add_argument("--metrics-api-key", default=None, help="require this key on /metrics too")
    g.add_argument("--chat-template", default=None, help="a jinja chat template: a file path or the template itself")
    g.add_argument("--max-queued-requests", type=int, default=None,
                   help="answer 429 when this many requests are already waiting in the engine")
    g.add_argument("--reasoning-parser", default=None, help="split <think> reasoning out: deepseek_r1 or qwen3")
    g.add_argument("--use-warmup", action="store_true", help="run one short request before accepting traffic")
    g.add_argument("--disable-log-requests", action="store_true", help="do not log each request")
    g.add_argument("--health-timeout", type=float, default=30.0,
                   help="/health answers 503 when the engine does not answer within this many seconds")
    g.add_argument("--engine-worker-queue-port", type=int, default=None,
                   help="loopback TCP port between API workers and the engine (default: an IPC socket file)")
    g.add_argument("--pd", default=None, metavar="XpYd",
                   help="one-command PD deployment: X prefill and Y decode instances behind a router on --port")
    g.add_argument("--policy", default="round_robin", choices=["round_robin", "least_load", "prefix_aware"],
                   help="how the PD router picks instances")
    g.add_argument("--uvicorn-log-level", default="warning")


def make_arg_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    from splitserve.entrypoints.cli import add_engine_args

    parser = parser or argparse.ArgumentParser(prog="splitserve serve",
                                               description="OpenAI-compatible server")
    parser.add_argument("model_tag", nargs="?", default=None, help="the model (same as --model)")
    add_engine_args(parser)
    add_server_args(parser)
    return parser


def split_args(ns: argparse.Namespace) -> tuple[EngineArgs, ServerArgs]:
    from splitserve.entrypoints.cli import engine_args_from

    if ns.model_tag is not None:
        if ns.model is not None and ns.model != ns.model_tag:
            raise ValueError(f"Two models given: {ns.model_tag!r} and --model {ns.model!r}.")
        ns.model = ns.model_tag
    server = ServerArgs(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(ServerArgs)})
    _check_server_args(server)
    return engine_args_from(ns), server


def _check_server_args(args: ServerArgs) -> None:
    from splitserve.entrypoints.openai.reasoning import REASONING_PARSERS

    if args.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {args.workers}.")
    if args.reasoning_parser is not None and args.reasoning_parser not in REASONING_PARSERS:
        raise ValueError(f"--reasoning-parser must be one of {sorted(REASONING_PARSERS)}, "
                         f"got {args.reasoning_parser!r}.")
    if args.max_queued_requests is not None and args.max_queued_requests < 0:
        raise ValueError("--max-queued-requests must be >= 0.")
    if args.chat_template is not None:
        args.chat_template = load_chat_template(args.chat_template)


def load_chat_template(value: str) -> str:
    """A file path or an inline jinja template (anything with template syntax is inline)."""
    if os.path.isfile(value):
        with open(value) as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value!r} is neither a readable file nor a jinja template.")


# --- processes -----------------------------------------------------------------------------------
def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def run_server(engine_args: EngineArgs, server_args: ServerArgs) -> None:
    from splitserve.engine.core_proc import EngineProcess
    from splitserve.entrypoints.openai.metrics import MULTIPROC_ENV

    config = engine_args.create_engine_config()
    multiproc_dir = None
    if server_args.workers > 1:
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
    # are stopped instead of outliving this process.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    engine = EngineProcess(config, address)
    workers: list[multiprocessing.Process] = []
    try:
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
        p = ctx.Process(target=serve_worker, args=(config, server_args, address, pid, index, sock, None),
                        name=f"splitserve-api-{index}")
        p.start()
        workers.append(p)
    logger.info("Started %d API server processes", len(workers))
    return workers


def _supervise(workers, engine, server_args: ServerArgs, metrics_sock) -> None:
    """The parent of several workers: serve the separate metrics port if any, and wait."""
    if metrics_sock is not None:
        import uvicorn

        from splitserve.entrypoints.openai.app import build_metrics_app

        uvicorn.Server(uvicorn.Config(build_metrics_app(server_args), log_level=server_args.uvicorn_log_level)
                       ).run(sockets=[metrics_sock])
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


def serve_worker(config: EngineConfig, server_args: ServerArgs, address: str, engine_pid: int, index: int,
                 sock: socket.socket, metrics_sock: socket.socket | None) -> None:
    """One API server process: an AsyncLLM client and uvicorn on the shared socket."""
    import uvicorn

    from splitserve.engine.core_proc import exit_with_parent

    if multiprocessing.parent_process() is not None:  # a worker process of a multi-worker server
        exit_with_parent()
    _quiet_threads()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s api-{index}: %(message)s")
    from splitserve.engine.async_llm import AsyncLLM
    from splitserve.entrypoints.openai.app import build_app, build_metrics_app

    engine = AsyncLLM(config.model_config, address, engine_pid, client_index=index)
    app = build_app(engine, config, server_args, index)
    servers = [uvicorn.Server(uvicorn.Config(app, log_level=server_args.uvicorn_log_level, timeout_keep_alive=30))]
    sockets = [[sock]]
    if metrics_sock is not None:
        servers.append(uvicorn.Server(uvicorn.Config(build_metrics_app(server_args),
                                                     log_level=server_args.uvicorn_log_level)))
        sockets.append([metrics_sock])
    logger.info("Serving %s on http://%s:%d", config.model_config.served_model_name, server_args.host,
                server_args.port)

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


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ns = make_arg_parser().parse_args(argv)
    try:
        from splitserve.disagg.launch import serve

        serve(*split_args(ns))
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        logger.error("%s", exc)
        sys.exit(2)


if __name__ == "__main__":
    main()
